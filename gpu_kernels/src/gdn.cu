// Kernels of the Qwen3.5 hybrids' ops (graph.h's head_slice, sigmoid_mul, rms_norm_gated,
// ssm_conv, gated_delta): the Gated DeltaNet layer and the gated attention's output gate. Each
// mirrors the CPU executor's behaviour (backends/cpu/cpu_executor.cpp) and the formulas of the
// CPU kernels (cpu_kernels/include/berth/cpu_kernels/gdn.h), including the per-sequence states
// and "a token at position 0 starts its sequence from zero". Grid sizes follow the shapes only;
// positions and sequence ids are read on the device, so captured graphs replay with new ones.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "launch.cuh"

namespace berth::gpu {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements (launch.cuh).
unsigned grid_for(int64_t n) { return grid_stride_blocks(n, kThreads); }

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// ---------------------------------------------------------------------------------------------
// head_slice, sigmoid_mul: element-wise, grid-stride.

__global__ void head_slice_kernel(const float* __restrict__ x, float* __restrict__ out,
                                  int64_t rows, int64_t n_group, int32_t group, int32_t offset,
                                  int32_t len) {
  pdl_enter();
  const int64_t out_cols = n_group * len, in_cols = n_group * group;
  const int64_t n = rows * out_cols;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / out_cols, c = idx - r * out_cols;
    const int64_t j = c / len, i = c - j * len;
    out[idx] = x[r * in_cols + j * group + offset + i];
  }
}

// out = x / (1 + exp(-gate)) (the reference's form of x * sigmoid(gate)). No __restrict__: out
// may alias x or gate (each element is read, then written, by one thread).
__global__ void sigmoid_mul_kernel(const float* x, const float* gate, float* out, int64_t n,
                                   int64_t cols, bool per_row) {
  pdl_enter();
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = per_row ? gate[idx / cols] : gate[idx];
    out[idx] = x[idx] / (1.0f + expf(-g));
  }
}

// ---------------------------------------------------------------------------------------------
// rms_norm_gated: one warp per run of `group` values (a V head's output, 128 in Qwen3.5), the
// sum of squares in double (as the CPU kernel), the scale 1 / sqrt(mean + eps) rounded to float.
// Runs of up to kNormPer * 32 values are loaded into registers once; longer ones loop twice.
// Each lane reads and writes only its own elements, so out may alias x or z.

constexpr int kNormWarps = 4;
constexpr int kNormPer = 8;

__global__ void __launch_bounds__(kNormWarps * 32)
    rms_norm_gated_kernel(const float* x, const float* z, const float* __restrict__ w, float* out,
                          int64_t runs, int32_t group, float eps) {
  pdl_enter();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t run = static_cast<int64_t>(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (run >= runs) return;  // the whole warp
  const int64_t base = run * group;
  const float* xr = x + base;
  const float* zr = z + base;
  float* yr = out + base;
  if (group <= 32 * kNormPer) {
    float v[kNormPer], zv[kNormPer];
    double ss = 0.0;
#pragma unroll
    for (int u = 0; u < kNormPer; ++u) {
      const int i = lane + 32 * u;
      v[u] = i < group ? xr[i] : 0.0f;
      zv[u] = i < group ? zr[i] : 0.0f;
      ss += static_cast<double>(v[u]) * v[u];
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float scale = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(group) + eps));
#pragma unroll
    for (int u = 0; u < kNormPer; ++u) {
      const int i = lane + 32 * u;
      if (i < group) yr[i] = v[u] * scale * w[i] * silu_f(zv[u]);
    }
    return;
  }
  double ss = 0.0;
  for (int i = lane; i < group; i += 32) {
    const double d = xr[i];
    ss += d * d;
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float scale = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(group) + eps));
  for (int i = lane; i < group; i += 32) yr[i] = xr[i] * scale * w[i] * silu_f(zr[i]);
}

// ---------------------------------------------------------------------------------------------
// Work split shared by ssm_conv and the delta rule: "parts" along grid.y. With n_prompt > 0
// prompt rows, part 0 is the prompt rows [0, n_prompt) in order and part 1 + d the decode row
// n_prompt + d; without prompt rows, part d is decode row d. Parts past gridDim.y are strided.

__device__ __forceinline__ void part_rows(int64_t part, int64_t n_prompt, int64_t& t0,
                                          int64_t& t1) {
  if (n_prompt > 0 && part == 0) {
    t0 = 0;
    t1 = n_prompt;
    return;
  }
  t0 = n_prompt + part - (n_prompt > 0 ? 1 : 0);
  t1 = t0 + 1;
}

int64_t n_parts(int64_t n_tok, int64_t n_decode) {
  return n_decode + (n_tok - n_decode > 0 ? 1 : 0);
}

unsigned parts_grid(int64_t parts) { return static_cast<unsigned>(parts > 65535 ? 65535 : parts); }

// ---------------------------------------------------------------------------------------------
// ssm_conv: a thread per channel (per part), the channel's K taps and K - 1 previous inputs in
// registers; prompt rows in chunks of kConvTok whose loads are issued together. A sequence
// switch between consecutive rows stores the window back to the old sequence's state and loads
// the new one's (or zeroes it at position 0).

constexpr int kConvThreads = 128;
constexpr int kConvTok = 16;  // prompt rows whose loads are issued together

template <int K>
__global__ void __launch_bounds__(kConvThreads)
    ssm_conv_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t channels,
                    const float* __restrict__ w, float* __restrict__ state,
                    const int32_t* __restrict__ positions, const int32_t* __restrict__ seqs,
                    int64_t n_prompt, int64_t parts) {
  pdl_enter();
  constexpr int H = K - 1;  // rows of state
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float wc[K];
#pragma unroll
  for (int i = 0; i < K; ++i) wc[i] = w[c * K + i];
  const int64_t seq_stride = static_cast<int64_t>(H) * channels;
  for (int64_t part = blockIdx.y; part < parts; part += gridDim.y) {
    int64_t t0, t1;
    part_rows(part, n_prompt, t0, t1);
    float win[H > 0 ? H : 1];  // win[H - 1] the newest input
    if (t1 - t0 == 1) {  // a decode row: every load at once (the state's is in bounds either way)
      const int32_t s = seqs ? seqs[t0] : 0;
      const bool restart = positions[t0] == 0;
      const float xt = x[t0 * channels + c];
      float* st = state + s * seq_stride + c;
#pragma unroll
      for (int i = 0; i < H; ++i) win[i] = st[i * channels];
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < H; ++i) acc = fmaf(wc[i], restart ? 0.0f : win[i], acc);
      acc = fmaf(wc[H], xt, acc);
      out[t0 * channels + c] = silu_f(acc);
#pragma unroll
      for (int i = 0; i + 1 < H; ++i) st[i * channels] = restart ? 0.0f : win[i + 1];
      if constexpr (H > 0) st[(H - 1) * channels] = xt;
      continue;
    }
    int32_t cur = 0;
    bool have = false;
    for (int64_t c0 = t0; c0 < t1; c0 += kConvTok) {
      // The chunk's inputs, positions and sequence ids: all loads in flight together.
      float xs[kConvTok];
      int32_t ss[kConvTok], ps[kConvTok];
#pragma unroll
      for (int u = 0; u < kConvTok; ++u) {
        const int64_t t = c0 + u;
        xs[u] = t < t1 ? x[t * channels + c] : 0.0f;
        ss[u] = t < t1 && seqs ? seqs[t] : 0;
        ps[u] = t < t1 ? positions[t] : 1;
      }
#pragma unroll
      for (int u = 0; u < kConvTok; ++u) {
        const int64_t t = c0 + u;
        if (t >= t1) break;
        const int32_t s = ss[u];
        const bool restart = ps[u] == 0;
        if (!have || s != cur) {
          if (have) {
            float* st = state + cur * seq_stride + c;
#pragma unroll
            for (int i = 0; i < H; ++i) st[i * channels] = win[i];
          }
          cur = s;
          have = true;
          if (!restart) {
            const float* st = state + s * seq_stride + c;
#pragma unroll
            for (int i = 0; i < H; ++i) win[i] = st[i * channels];
          }
        }
        if (restart) {
#pragma unroll
          for (int i = 0; i < H; ++i) win[i] = 0.0f;
        }
        const float xt = xs[u];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < H; ++i) acc = fmaf(wc[i], win[i], acc);
        acc = fmaf(wc[H], xt, acc);
        out[t * channels + c] = silu_f(acc);
#pragma unroll
        for (int i = 0; i + 1 < H; ++i) win[i] = win[i + 1];
        if constexpr (H > 0) win[H - 1] = xt;
      }
    }
    if (have) {
      float* st = state + cur * seq_stride + c;
#pragma unroll
      for (int i = 0; i < H; ++i) st[i * channels] = win[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// gated_delta, launch 1 (prep): per token, a warp per K head j L2-normalises q_j and k_j (sum of
// squares in double, y = x * (1 / sqrt(ss + eps)) rounded to float: cpu::l2_norm's formula) into
// the workspace, padded with zeros to dkp values, and stores k_j . q_j (float); the warp after
// the K heads computes the gates of the token's V heads in double (as ref::gdn_gates).
//
// Workspace layout (gated_delta_workspace_bytes), each array at a 256-byte boundary:
//   qk   [n_tok][2 * hk][dkp] f32: the normalised q heads then k heads, zero past dk
//   kq   [n_tok][hk] f32:          k_j . q_j of the normalised heads
//   g    [n_tok][hv] f32:          ssm_a * softplus(alpha + dt_bias)
//   beta [n_tok][hv] f32:          sigmoid(b)

constexpr int kPrepWarps = 4;
constexpr int kPrepPer = 8;  // values per lane: dkp <= 256

__global__ void __launch_bounds__(kPrepWarps * 32)
    gdn_prep_kernel(const float* __restrict__ y, const float* __restrict__ alpha,
                    const float* __restrict__ b, const float* __restrict__ ssm_a,
                    const float* __restrict__ dt_bias, int64_t y_cols, int32_t hk, int32_t hv,
                    int32_t dk, int32_t dkp, float eps, float* __restrict__ qk,
                    float* __restrict__ kq, float* __restrict__ g, float* __restrict__ beta) {
  pdl_enter();
  const int64_t t = blockIdx.x;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int wid = static_cast<int>(blockIdx.y) * kPrepWarps + static_cast<int>(threadIdx.x) / 32;
  if (wid < hk) {
    const float* yq = y + t * y_cols + static_cast<int64_t>(wid) * dk;
    const float* yk = yq + static_cast<int64_t>(hk) * dk;
    float qv[kPrepPer], kv[kPrepPer];
    double sq = 0.0, sk = 0.0;
#pragma unroll
    for (int u = 0; u < kPrepPer; ++u) {
      const int i = lane + 32 * u;
      qv[u] = i < dk ? yq[i] : 0.0f;
      kv[u] = i < dk ? yk[i] : 0.0f;
      sq += static_cast<double>(qv[u]) * qv[u];
      sk += static_cast<double>(kv[u]) * kv[u];
    }
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    const double iq = 1.0 / sqrt(sq + static_cast<double>(eps));
    const double ik = 1.0 / sqrt(sk + static_cast<double>(eps));
    float* oq = qk + (t * 2 * hk + wid) * dkp;
    float* ok = qk + (t * 2 * hk + hk + wid) * dkp;
    float dot = 0.0f;
#pragma unroll
    for (int u = 0; u < kPrepPer; ++u) {
      const int i = lane + 32 * u;
      if (i < dkp) {
        const auto a = static_cast<float>(qv[u] * iq);  // zero past dk
        const auto c = static_cast<float>(kv[u] * ik);
        oq[i] = a;
        ok[i] = c;
        dot = fmaf(a, c, dot);
      }
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) kq[t * hk + wid] = dot;
  } else if (wid == hk) {
    for (int h = lane; h < hv; h += 32) {
      const double u = static_cast<double>(alpha[t * hv + h]) + dt_bias[h];
      const double sp = u > 20.0 ? u : log1p(exp(u));
      g[t * hv + h] = static_cast<float>(static_cast<double>(ssm_a[h]) * sp);
      beta[t * hv + h] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(b[t * hv + h]))));
    }
  }
}

// gated_delta, launch 2 (the recurrence). A block of kDeltaThreads threads serves kDeltaThreads /
// L state columns of one V head h; L consecutive lanes share a column j, each holding NR of its
// dkp = L * NR rows in registers: lane `sub` owns rows 4 * (sub + L * m) + e (m < NR / 4, e < 4),
// so its q and k values are float4 reads of shared memory. Per token (the CPU SIMD kernel's form,
// algebraically equal to decay, delta, update, output):
//   sk = S^T k, sq = S^T q (the old S; four partial sums per lane, then xor shuffles over the L
//   lanes, the same bits on every lane), decay = exp(g), delta = beta * (v - decay * sk),
//   out = scale * (decay * sq + (k . q) * delta), S = decay * S + k * delta.
// Rows past dk are zero in S, q and k, and stay zero. Columns past dv run along (their lanes
// take part in the shuffles) with v = 0 and touch no memory.
// Tokens come in chunks of kDeltaTok: the block stages a chunk's q, k (the head's), v (its
// columns) and scalars in shared memory (two buffers); the next chunk's loads are issued into
// registers before the current chunk is processed, and stored to the other buffer after it.
// Prompt rows are one dependent chain per column (measured on an H200, dk = dv = 128: about
// 0.35 us per token; a decode step of hv = 16 about 5 us with its prep launch): a chunked
// prefill form is left for later.
constexpr int kDeltaThreads = 128;
constexpr int kDeltaTok = 8;
constexpr int kDeltaRows = 16;  // state rows per lane (NR)

struct DeltaArgs {
  const float* qk;
  const float* kq;
  const float* g;
  const float* beta;
  const float* y;  // v at y + t * y_cols + v_off + h * dv
  int64_t y_cols, v_off;
  int32_t hk, hv, dk, dv, col_blocks;
  float scale;
  float* state;
  const int32_t* positions;
  const int32_t* seqs;
  int64_t n_prompt, parts;
  float* out;
};

template <int L, int NR>
__global__ void __launch_bounds__(kDeltaThreads) gdn_recur_kernel(const DeltaArgs a) {
  pdl_enter();
  static_assert(NR % 4 == 0 && 32 % L == 0, "lane split");
  constexpr int kCols = kDeltaThreads / L, kChunks = NR / 4, kDkp = L * NR;
  constexpr int kQK4 = 2 * kDeltaTok * (kDkp / 4);  // float4s of q and k per chunk
  static_assert(kQK4 % kDeltaThreads == 0, "q/k split");
  constexpr int kQKPer = kQK4 / kDeltaThreads;
  constexpr int kVPer = (kDeltaTok * kCols + kDeltaThreads - 1) / kDeltaThreads;
  __shared__ __align__(16) float s_qk[2][kDeltaTok][2][kDkp];  // [buf][token][q, k][row]
  __shared__ float s_v[2][kDeltaTok][kCols];
  __shared__ float s_g[2][kDeltaTok], s_b[2][kDeltaTok], s_kq[2][kDeltaTok];
  __shared__ int32_t s_seq[2][kDeltaTok], s_pos[2][kDeltaTok];

  const int tid = static_cast<int>(threadIdx.x);
  const int sub = tid % L;
  const int h = static_cast<int>(blockIdx.x) / a.col_blocks;
  const int col0 = (static_cast<int>(blockIdx.x) % a.col_blocks) * kCols;
  const int j = col0 + tid / L;
  const bool valid = j < a.dv;
  const int jk = h % a.hk;  // V head h reads K head h mod H_k
  const int64_t head_state = static_cast<int64_t>(a.dk) * a.dv;
  const int64_t seq_state = head_state * a.hv;
  const int64_t out_cols = static_cast<int64_t>(a.hv) * a.dv;
  const auto row = [&](int m, int e) { return 4 * (sub + L * m) + e; };

  // One chunk's inputs in flight, in registers.
  float4 r_qk[kQKPer];
  float r_v[kVPer];
  float r_g = 0.0f, r_b = 0.0f, r_kq = 0.0f;
  int32_t r_seq = 0, r_pos = 0;
  const auto load_chunk = [&](int64_t c0, int n) {
#pragma unroll
    for (int u = 0; u < kQKPer; ++u) {
      const int idx = tid + u * kDeltaThreads;
      const int tt = idx / (2 * kDkp / 4), rem = idx % (2 * kDkp / 4);
      const int which = rem / (kDkp / 4), f = rem % (kDkp / 4);
      if (tt < n)
        r_qk[u] = __ldg(reinterpret_cast<const float4*>(
            a.qk + ((c0 + tt) * 2 * a.hk + which * a.hk + jk) * kDkp + 4 * f));
    }
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int idx = tid + u * kDeltaThreads;
      const int tt = idx / kCols, jj = col0 + idx % kCols;
      r_v[u] = idx < kDeltaTok * kCols && tt < n && jj < a.dv
                   ? a.y[(c0 + tt) * a.y_cols + a.v_off + static_cast<int64_t>(h) * a.dv + jj]
                   : 0.0f;
    }
    if (tid < n) {
      const int64_t t = c0 + tid;
      r_g = a.g[t * a.hv + h];
      r_b = a.beta[t * a.hv + h];
      r_kq = a.kq[t * a.hk + jk];
      r_seq = a.seqs ? a.seqs[t] : 0;
      r_pos = a.positions[t];
    }
  };
  const auto store_chunk = [&](int buf, int n) {
#pragma unroll
    for (int u = 0; u < kQKPer; ++u) {
      const int idx = tid + u * kDeltaThreads;
      const int tt = idx / (2 * kDkp / 4), rem = idx % (2 * kDkp / 4);
      const int which = rem / (kDkp / 4), f = rem % (kDkp / 4);
      if (tt < n) *reinterpret_cast<float4*>(&s_qk[buf][tt][which][4 * f]) = r_qk[u];
    }
#pragma unroll
    for (int u = 0; u < kVPer; ++u) {
      const int idx = tid + u * kDeltaThreads;
      if (idx < kDeltaTok * kCols) s_v[buf][idx / kCols][idx % kCols] = r_v[u];
    }
    if (tid < n) {
      s_g[buf][tid] = r_g;
      s_b[buf][tid] = r_b;
      s_kq[buf][tid] = r_kq;
      s_seq[buf][tid] = r_seq;
      s_pos[buf][tid] = r_pos;
    }
  };

  float S[NR];
  // Lane `sub`'s rows of column j: chunk m starts at row 4 * sub + 4 * L * m.
  const int dk_rows = a.dk - 4 * sub;  // rows of chunk m, element e exist when 4*L*m + e < this
  const auto store_state = [&](int32_t s) {
    if (!valid) return;
    float* st = a.state + s * seq_state + h * head_state + static_cast<int64_t>(4 * sub) * a.dv + j;
#pragma unroll
    for (int m = 0; m < kChunks; ++m, st += 4 * L * a.dv)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * L * m + e < dk_rows) st[e * a.dv] = S[4 * m + e];
  };
  const auto load_state = [&](int32_t s) {
    const float* st =
        a.state + s * seq_state + h * head_state + static_cast<int64_t>(4 * sub) * a.dv + j;
#pragma unroll
    for (int m = 0; m < kChunks; ++m, st += 4 * L * a.dv)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        S[4 * m + e] = valid && 4 * L * m + e < dk_rows ? st[e * a.dv] : 0.0f;
  };

  for (int64_t part = blockIdx.y; part < a.parts; part += gridDim.y) {
    int64_t t0, t1;
    part_rows(part, a.n_prompt, t0, t1);
    int32_t cur = 0;
    bool have = false;
    int buf = 0;
    load_chunk(t0, static_cast<int>(t1 - t0 < kDeltaTok ? t1 - t0 : kDeltaTok));
    for (int64_t c0 = t0; c0 < t1; c0 += kDeltaTok) {
      const int n = static_cast<int>(t1 - c0 < kDeltaTok ? t1 - c0 : kDeltaTok);
      // The buffer written here was last read two chunks ago, before the previous barrier.
      store_chunk(buf, n);
      __syncthreads();
      const int64_t c1 = c0 + kDeltaTok;
      if (c1 < t1) load_chunk(c1, static_cast<int>(t1 - c1 < kDeltaTok ? t1 - c1 : kDeltaTok));
#pragma unroll 1
      for (int tt = 0; tt < n; ++tt) {
        const int32_t seq = s_seq[buf][tt], pos = s_pos[buf][tt];
        if (!have || seq != cur) {
          if (have) store_state(cur);
          cur = seq;
          have = true;
          if (pos != 0) load_state(cur);
        }
        if (pos == 0) {
#pragma unroll
          for (int r = 0; r < NR; ++r) S[r] = 0.0f;
        }
        const float* q = &s_qk[buf][tt][0][0];
        const float* k = &s_qk[buf][tt][1][0];
        float kr[NR];
        float pk[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pq[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int m = 0; m < kChunks; ++m) {
          const float4 q4 = *reinterpret_cast<const float4*>(q + row(m, 0));
          const float4 k4 = *reinterpret_cast<const float4*>(k + row(m, 0));
          kr[4 * m] = k4.x, kr[4 * m + 1] = k4.y, kr[4 * m + 2] = k4.z, kr[4 * m + 3] = k4.w;
          pk[0] = fmaf(S[4 * m], k4.x, pk[0]);
          pk[1] = fmaf(S[4 * m + 1], k4.y, pk[1]);
          pk[2] = fmaf(S[4 * m + 2], k4.z, pk[2]);
          pk[3] = fmaf(S[4 * m + 3], k4.w, pk[3]);
          pq[0] = fmaf(S[4 * m], q4.x, pq[0]);
          pq[1] = fmaf(S[4 * m + 1], q4.y, pq[1]);
          pq[2] = fmaf(S[4 * m + 2], q4.z, pq[2]);
          pq[3] = fmaf(S[4 * m + 3], q4.w, pq[3]);
        }
        float sk = (pk[0] + pk[1]) + (pk[2] + pk[3]);
        float sq = (pq[0] + pq[1]) + (pq[2] + pq[3]);
#pragma unroll
        for (int o = 1; o < L; o <<= 1) {
          sk += __shfl_xor_sync(0xffffffffu, sk, o);
          sq += __shfl_xor_sync(0xffffffffu, sq, o);
        }
        const float decay = expf(s_g[buf][tt]);
        const float delta = s_b[buf][tt] * (s_v[buf][tt][tid / L] - decay * sk);
        const float o = a.scale * fmaf(s_kq[buf][tt], delta, decay * sq);
#pragma unroll
        for (int r = 0; r < NR; ++r) S[r] = fmaf(kr[r], delta, decay * S[r]);
        if (valid && sub == 0) a.out[(c0 + tt) * out_cols + static_cast<int64_t>(h) * a.dv + j] = o;
      }
      buf ^= 1;
    }
    if (have) store_state(cur);
    __syncthreads();  // the next part's first store_chunk reuses buffer 0
  }
}

// The padded K head size of the workspace and the recurrence's lane split for it.
int32_t delta_dkp(int32_t dk) {
  int32_t p = 32;
  while (p < dk) p *= 2;
  return p;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

void head_slice(const float* x, float* out, int64_t rows, int64_t n_group, int32_t group,
                int32_t offset, int32_t len, cudaStream_t stream) {
  if (rows < 0 || n_group < 0 || group <= 0 || offset < 0 || len < 0 ||
      static_cast<int64_t>(offset) + len > group)
    bad_arg("gpu::head_slice: columns [" + std::to_string(offset) + ", " +
            std::to_string(static_cast<int64_t>(offset) + len) + ") of groups of " +
            std::to_string(group) + " (" + std::to_string(rows) + " rows, " +
            std::to_string(n_group) + " groups)");
  const int64_t n = rows * n_group * len;
  if (n == 0) return;
  launch("head_slice_kernel", head_slice_kernel, grid_for(n), kThreads, 0, stream, x, out, rows,
         n_group, group, offset, len);
}

void sigmoid_mul(const float* x, const float* gate, float* out, int64_t rows, int64_t cols,
                 bool per_row, cudaStream_t stream) {
  if (rows < 0 || cols < 0)
    bad_arg("gpu::sigmoid_mul: shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  const int64_t n = rows * cols;
  if (n == 0) return;
  launch("sigmoid_mul_kernel", sigmoid_mul_kernel, grid_for(n), kThreads, 0, stream, x, gate, out,
         n, cols, per_row);
}

void rms_norm_gated(const float* x, const float* z, const float* w, float* out, int64_t rows,
                    int64_t cols, int32_t group, float eps, cudaStream_t stream) {
  if (group <= 0 || rows < 0 || cols < 0 || cols % group != 0)
    bad_arg("gpu::rms_norm_gated: group " + std::to_string(group) + " does not divide cols " +
            std::to_string(cols));
  const int64_t runs = rows * (cols / group);
  if (runs == 0) return;
  const int64_t blocks = (runs + kNormWarps - 1) / kNormWarps;
  if (blocks > 0x7fffffff) bad_arg("gpu::rms_norm_gated: too many rows");
  launch("rms_norm_gated_kernel", rms_norm_gated_kernel, static_cast<unsigned>(blocks),
         kNormWarps * 32, 0, stream, x, z, w, out, runs, group, eps);
}

void ssm_conv(const float* x, float* out, int64_t n_tok, int64_t channels, const float* w,
              int32_t kernel, float* state, const int32_t* positions, const int32_t* seqs,
              int64_t n_decode, cudaStream_t stream) {
  if (kernel < 1 || kernel > 8)
    bad_arg("gpu::ssm_conv: kernel " + std::to_string(kernel) + " outside [1, 8]");
  if (n_tok < 0 || channels < 0 || n_decode < 0 || n_decode > n_tok)
    bad_arg("gpu::ssm_conv: n_decode " + std::to_string(n_decode) +
            " outside [0, n_tok = " + std::to_string(n_tok) + "] or a negative shape");
  if (n_tok == 0 || channels == 0) return;
  if (!positions) bad_arg("gpu::ssm_conv: positions are required");
  const int64_t blocks = (channels + kConvThreads - 1) / kConvThreads;
  if (blocks > 0x7fffffff) bad_arg("gpu::ssm_conv: too many channels");
  const int64_t parts = n_parts(n_tok, n_decode);
  const dim3 grid(static_cast<unsigned>(blocks), parts_grid(parts));
  const int64_t n_prompt = n_tok - n_decode;
#define BERTH_SSM_CONV_CASE(K)                                                                     \
  case K:                                                                                          \
    launch("ssm_conv_kernel", ssm_conv_kernel<K>, grid, kConvThreads, 0, stream, x, out, channels, \
           w, state, positions, seqs, n_prompt, parts);                                            \
    return;
  switch (kernel) {
    BERTH_SSM_CONV_CASE(1)
    BERTH_SSM_CONV_CASE(2)
    BERTH_SSM_CONV_CASE(3)
    BERTH_SSM_CONV_CASE(4)
    BERTH_SSM_CONV_CASE(5)
    BERTH_SSM_CONV_CASE(6)
    BERTH_SSM_CONV_CASE(7)
    BERTH_SSM_CONV_CASE(8)
    default:
      break;
  }
#undef BERTH_SSM_CONV_CASE
}

size_t gated_delta_workspace_bytes(int64_t n_tok, int32_t hk, int32_t hv, int32_t dk) {
  if (n_tok <= 0 || hk <= 0 || hv <= 0 || dk <= 0) return 0;
  const auto nt = static_cast<size_t>(n_tok);
  const auto f = sizeof(float);
  return align256(nt * 2 * static_cast<size_t>(hk) * static_cast<size_t>(delta_dkp(dk)) * f) +
         align256(nt * static_cast<size_t>(hk) * f) +
         2 * align256(nt * static_cast<size_t>(hv) * f);
}

void gated_delta(const float* y, const float* alpha, const float* b, const float* ssm_a,
                 const float* dt_bias, int64_t n_tok, int32_t hk, int32_t hv, int32_t dk,
                 int32_t dv, float eps, float* state, const int32_t* positions, const int32_t* seqs,
                 int64_t n_decode, float* out, void* ws, size_t ws_bytes, cudaStream_t stream) {
  if (hk < 1 || hv < 1 || hv % hk != 0)
    bad_arg("gpu::gated_delta: " + std::to_string(hv) + " V heads are not a multiple of " +
            std::to_string(hk) + " K heads");
  if (dk < 1 || dk > 256 || dv < 1 || dv > 256)
    bad_arg("gpu::gated_delta: head sizes d_k " + std::to_string(dk) + ", d_v " +
            std::to_string(dv) + " outside [1, 256]");
  if (n_tok < 0 || n_decode < 0 || n_decode > n_tok)
    bad_arg("gpu::gated_delta: n_decode " + std::to_string(n_decode) +
            " outside [0, n_tok = " + std::to_string(n_tok) + "]");
  if (n_tok == 0) return;
  if (!positions) bad_arg("gpu::gated_delta: positions are required");
  const size_t need = gated_delta_workspace_bytes(n_tok, hk, hv, dk);
  if (ws_bytes < need || !ws || reinterpret_cast<uintptr_t>(ws) % 16 != 0)
    bad_arg("gpu::gated_delta: workspace of " + std::to_string(ws_bytes) + " bytes, " +
            std::to_string(need) + " (16-byte aligned) needed");
  if (n_tok > 0x7fffffff) bad_arg("gpu::gated_delta: too many tokens");
  const int32_t dkp = delta_dkp(dk);
  const auto nt = static_cast<size_t>(n_tok);
  auto* base = static_cast<char*>(ws);
  auto* qk = reinterpret_cast<float*>(base);
  base += align256(nt * 2 * static_cast<size_t>(hk) * static_cast<size_t>(dkp) * sizeof(float));
  auto* kq = reinterpret_cast<float*>(base);
  base += align256(nt * static_cast<size_t>(hk) * sizeof(float));
  auto* g = reinterpret_cast<float*>(base);
  base += align256(nt * static_cast<size_t>(hv) * sizeof(float));
  auto* beta = reinterpret_cast<float*>(base);

  const int64_t y_cols = 2 * static_cast<int64_t>(hk) * dk + static_cast<int64_t>(hv) * dv;
  const dim3 prep_grid(static_cast<unsigned>(n_tok),
                       static_cast<unsigned>((hk + 1 + kPrepWarps - 1) / kPrepWarps));
  launch("gdn_prep_kernel", gdn_prep_kernel, prep_grid, kPrepWarps * 32, 0, stream, y, alpha, b,
         ssm_a, dt_bias, y_cols, hk, hv, dk, dkp, eps, qk, kq, g, beta);

  // Lane split: kDeltaRows rows of a column per lane, dkp / kDeltaRows lanes per column.
  const int lanes = dkp / kDeltaRows;
  const int cols_per_block = kDeltaThreads / lanes;
  DeltaArgs a{};
  a.qk = qk;
  a.kq = kq;
  a.g = g;
  a.beta = beta;
  a.y = y;
  a.y_cols = y_cols;
  a.v_off = 2 * static_cast<int64_t>(hk) * dk;
  a.hk = hk;
  a.hv = hv;
  a.dk = dk;
  a.dv = dv;
  a.col_blocks = (dv + cols_per_block - 1) / cols_per_block;
  a.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  a.state = state;
  a.positions = positions;
  a.seqs = seqs;
  a.n_prompt = n_tok - n_decode;
  a.parts = n_parts(n_tok, n_decode);
  a.out = out;
  const dim3 grid(static_cast<unsigned>(hv) * static_cast<unsigned>(a.col_blocks),
                  parts_grid(a.parts));
  switch (lanes) {
    case 2:
      launch("gdn_recur_kernel", gdn_recur_kernel<2, kDeltaRows>, grid, kDeltaThreads, 0, stream,
             a);
      break;
    case 4:
      launch("gdn_recur_kernel", gdn_recur_kernel<4, kDeltaRows>, grid, kDeltaThreads, 0, stream,
             a);
      break;
    case 8:
      launch("gdn_recur_kernel", gdn_recur_kernel<8, kDeltaRows>, grid, kDeltaThreads, 0, stream,
             a);
      break;
    default:
      launch("gdn_recur_kernel", gdn_recur_kernel<16, kDeltaRows>, grid, kDeltaThreads, 0, stream,
             a);
      break;
  }
}

}  // namespace berth::gpu
