// Causal grouped-query attention over an f16 KV cache, flash-style (FlashAttention: Dao et al.,
// arXiv:2205.14135; split-KV decoding as in "Flash-Decoding"). One kernel serves decode and
// prefill:
//
// - A block takes kQB query rows that share one KV head (rows are (token, query head) pairs of
//   that head's group, token-major), and streams K/V tiles of kT cache rows through shared memory
//   with an online softmax per row (running max m and sum l, in the log2 domain: q is scaled by
//   scale * log2(e) on load so scores go straight into exp2f). The score matrix is never stored
//   beyond one kQB x kT tile.
// - Warp w owns rows w, w+4, w+8, w+12 of the block for the whole tile loop (scores, softmax,
//   P.V), so only the tile loads need the whole block. In the score step a lane owns two cache
//   rows; in P.V a lane owns head-dim pairs lane + 32c.
// - A block's tokens form runs of one sequence each; per run, the KV range [0, the run's last
//   position + 1) of that sequence's rows (sequence s: rows s * n_ctx + ...) is read from
//   positions[] and seqs[] on the device and cut into gridDim.x equal splits (a multiple of kT
//   each) while the block's other rows are masked out. Prompt rows run with one split (tiles of
//   kT from position 0); decode rows on this kernel (devices without clusters) with the splits
//   of a one-token call, a function of n_ctx only, so a graph captured at one position replays
//   at any other and a row's bits never depend on the step. With one split the kernel writes
//   the normalised output; with more, each split writes (m, l, unnormalised acc) to the
//   workspace and attn_combine_kernel merges them.
//
// K/V of this ubatch are first written (rounded to f16) into the cache rows seqs[t] * n_ctx +
// positions[t] by kv_write_kernel, launched before the attention kernel in the same stream. Decode
// rows on compute capability >= 9.0 take attention_decode_kernel instead (below), one launch for
// all of them (clusters per token, KV head and head subgroup) that also writes their K/V rows,
// followed by attn_dec_combine_kernel where a long KV range is split over several clusters.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "act_quant.cuh"
#include "berth/core/env.h"
#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "launch.cuh"
#include "matmul_internal.h"
#include "mma.cuh"
#include "wgmma.cuh"

namespace berth::gpu {
namespace {

constexpr int kQB = 16;    // query rows per block
constexpr int kWarps = 4;  // warps per block
constexpr int kRowsPerWarp = kQB / kWarps;
constexpr int kT = 64;  // cache rows per tile
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPairsPerLane = kMaxHeadDim / 2 / 32;  // head-dim pairs a lane owns in P.V
constexpr int kMaxSplits = 64;

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

// The environment variable `name` (unset or empty: 0), one of `ok`; any other value is
// Error(invalid_argument) naming the variable.
int env_choice(const char* name, std::initializer_list<int> ok) {
  const auto v = static_cast<int>(env_uint(name, 1024).value_or(0));
  std::string list;
  for (const int o : ok) {
    if (o == v) return v;
    list += (list.empty() ? "" : ", ") + std::to_string(o);
  }
  bad_arg(std::string(name) + "='" + std::to_string(v) + "': expected one of " + list);
  return 0;
}

// Shared memory of the attention kernel for a head dim, in 32-bit words: Q [kQB][hd] f32,
// P [kQB][kT] f32, K [kT][hd/2 + 1] half2 (one pad word: lanes reading different rows at the
// same column hit different banks), V [kT][hd/2] half2.
constexpr size_t smem_words(int hd) {
  return static_cast<size_t>(kQB) * hd + kQB * kT + kT * (hd / 2 + 1) + kT * (hd / 2);
}

// Number of KV splits: enough blocks to fill the GPU for short query batches (about 512 blocks,
// guessing 8 query rows per block), at most one per tile of cache positions and kMaxSplits: a
// decode block walks a single tile while the cache holds up to kT * kMaxSplits positions.
// (One split per 128 positions before: on the H200, all-GPU tg128 after a 512-token prompt of
// synthetic qwen3-30b-a3b went 200.4 -> 203.6 tok/s.)
int64_t attention_splits(int64_t n_tok, int64_t n_ctx, int32_t n_head) {
  const int64_t blocks = (n_tok * n_head + 7) / 8;
  int64_t s = (512 + blocks - 1) / blocks;
  const int64_t by_ctx = (n_ctx + kT - 1) / kT;
  if (s > by_ctx) s = by_ctx;
  if (s > kMaxSplits) s = kMaxSplits;
  return s < 1 ? 1 : s;
}

__global__ void kv_write_kernel(const float* k, const float* v, int64_t n_tok,
                                const int32_t* positions, const int32_t* seqs, __half* k_cache,
                                __half* v_cache, int64_t n_ctx, int64_t kv_dim) {
  pdl_enter();
  const int64_t n = n_tok * kv_dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / kv_dim, c = i % kv_dim;
    const int64_t p = positions[t], sq = seqs ? seqs[t] : 0;
    // The host validates positions and sequences; never write outside.
    if (p < 0 || p >= n_ctx || sq < 0) continue;
    const int64_t row = sq * n_ctx + p;
    k_cache[row * kv_dim + c] = __float2half_rn(k[i]);
    v_cache[row * kv_dim + c] = __float2half_rn(v[i]);
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float2 h2f(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, 4);
  return __half22float2(h);
}

// Sequence runs of a block's tokens (a step lists each sequence's tokens together). From token
// ta, the run's last token (ta <= tb <= t_last, same sequence as ta; seqs null: one sequence)
// is returned and its largest position stored in `ext`.
__device__ __forceinline__ int64_t seq_run_end(const int32_t* __restrict__ positions,
                                               const int32_t* __restrict__ seqs, int64_t ta,
                                               int64_t t_last, int64_t& ext) {
  const int32_t sq = seqs ? seqs[ta] : 0;
  int64_t tb = ta;
  ext = positions[ta];
  while (tb < t_last && (seqs ? seqs[tb + 1] : 0) == sq) {
    ++tb;
    if (positions[tb] > ext) ext = positions[tb];
  }
  return tb;
}

// Position of attention row gr (token gr / group) when the row exists and its token lies in the
// run [ta, tb]; -1 otherwise.
__device__ __forceinline__ int64_t run_row_pos(const int32_t* __restrict__ positions, int64_t gr,
                                               int64_t rows_total, int64_t group, int64_t ta,
                                               int64_t tb) {
  const int64_t t = gr / group;
  return gr < rows_total && t >= ta && t <= tb ? static_cast<int64_t>(positions[t]) : -1;
}

// Copies cache rows [j0, j0 + kT) of one KV head into the K/V tiles (rows at or past `end`
// become zeros, never stale cache bits). Units of W 32-bit words (W = 2: 8-byte loads when
// head_dim % 4 == 0); each thread issues kBatch units of K and of V before storing any, so a
// tile costs a few memory latencies instead of one per unit.
template <int W>
__device__ __forceinline__ void load_tile(const uint32_t* __restrict__ k_cache,
                                          const uint32_t* __restrict__ v_cache, uint32_t* Ks,
                                          uint32_t* Vs, int64_t j0, int64_t end, int64_t kv_stride2,
                                          int32_t kvh, int hd2, int tid) {
  using Unit = typename std::conditional<W == 2, uint2, uint32_t>::type;
  constexpr int kBatch = 8;
  const int units_per_row = hd2 / W;
  const int total = kT * units_per_row;
  for (int base = 0; base < total; base += kBatch * kThreads) {
    Unit kw[kBatch], vw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads + tid;
      kw[u] = vw[u] = Unit{};
      if (i < total) {
        const int r = i / units_per_row, c = (i % units_per_row) * W;
        const int64_t j = j0 + r;
        if (j < end) {
          const int64_t g = j * kv_stride2 + static_cast<int64_t>(kvh) * hd2 + c;
          kw[u] = *reinterpret_cast<const Unit*>(k_cache + g);
          vw[u] = *reinterpret_cast<const Unit*>(v_cache + g);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = base + u * kThreads + tid;
      if (i < total) {
        const int r = i / units_per_row, c = (i % units_per_row) * W;
        const uint32_t* kp = reinterpret_cast<const uint32_t*>(&kw[u]);
        const uint32_t* vp = reinterpret_cast<const uint32_t*>(&vw[u]);
#pragma unroll
        for (int w = 0; w < W; ++w) {
          Ks[r * (hd2 + 1) + c + w] = kp[w];
          Vs[r * hd2 + c + w] = vp[w];
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    attention_kernel(const float* __restrict__ q, const uint32_t* __restrict__ k_cache,
                     const uint32_t* __restrict__ v_cache, const int32_t* __restrict__ positions,
                     const int32_t* __restrict__ seqs, int64_t n_tok, int64_t n_ctx, int32_t n_head,
                     int32_t n_head_kv, int32_t hd, float q_scale, bool wide,
                     float* __restrict__ out, float* __restrict__ ws_acc,
                     float* __restrict__ ws_ml) {
  pdl_enter();
  extern __shared__ float4 smem4[];
  float* Qs = reinterpret_cast<float*>(smem4);
  float* Ps = Qs + kQB * hd;
  const int hd2 = hd / 2;
  uint32_t* Ks = reinterpret_cast<uint32_t*>(Ps + kQB * kT);
  uint32_t* Vs = Ks + kT * (hd2 + 1);

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int32_t group = n_head / n_head_kv;
  const int32_t kvh = static_cast<int32_t>(blockIdx.z);
  const int64_t rows_total = n_tok * group;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kQB;
  const int64_t q_stride = static_cast<int64_t>(n_head) * hd;
  const int64_t kv_stride2 = static_cast<int64_t>(n_head_kv) * hd2;  // cache row, in half2

  for (int i = tid; i < kQB * hd; i += kThreads) {
    const int lr = i / hd, d = i % hd;
    const int64_t gr = r0 + lr;
    float x = 0.0f;
    if (gr < rows_total) {
      const int64_t t = gr / group;
      const int32_t h = kvh * group + static_cast<int32_t>(gr % group);
      x = q[t * q_stride + static_cast<int64_t>(h) * hd + d] * q_scale;
    }
    Qs[i] = x;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp];
  float acc[kRowsPerWarp][kMaxPairsPerLane][2];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    m[i] = -CUDART_INF_F;
    l[i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxPairsPerLane; ++c) acc[i][c][0] = acc[i][c][1] = 0.0f;
  }

  // The block's tokens form runs of one sequence (a step lists a sequence's tokens together).
  // Each run streams its own sequence's rows [0, its last position + 1) while the block's other
  // rows are masked out: a masked tile leaves a row's m, l and acc bit for bit as they were
  // (max with -inf, alpha = 1, p = 0 times finite values), so a row's result depends on its own
  // sequence and position only, never on which tokens share its block (issue 19).
  const int64_t n_splits = gridDim.x;
  const int64_t gr_last = (r0 + kQB < rows_total ? r0 + kQB : rows_total) - 1;
  const int64_t t_last = gr_last / group;
  for (int64_t ta = r0 / group; ta <= t_last;) {
    const int32_t sq = seqs ? seqs[ta] : 0;
    int64_t ext = 0;
    const int64_t tb = seq_run_end(positions, seqs, ta, t_last, ext);
    // This warp's rows of the run and their positions (-1: not in the run).
    int64_t pos[kRowsPerWarp];
    int64_t warp_max_pos = -1;
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      pos[i] = run_row_pos(positions, r0 + warp + kWarps * i, rows_total, group, ta, tb);
      if (pos[i] > warp_max_pos) warp_max_pos = pos[i];
    }
    int64_t n_kv = ext + 1;
    if (n_kv > n_ctx) n_kv = n_ctx;
    int64_t chunk = (n_kv + n_splits - 1) / n_splits;
    chunk = (chunk + kT - 1) / kT * kT;
    const int64_t start = static_cast<int64_t>(blockIdx.x) * chunk;
    const int64_t end = start + chunk < n_kv ? start + chunk : n_kv;
    const int64_t base = static_cast<int64_t>(sq < 0 ? 0 : sq) * n_ctx;  // the run's first row
    const uint32_t* kc = k_cache + base * kv_stride2;
    const uint32_t* vc = v_cache + base * kv_stride2;

    for (int64_t j0 = start; j0 < end; j0 += kT) {
      __syncthreads();  // previous tile fully consumed (and Q stored, on the first pass)
      if (wide)
        load_tile<2>(kc, vc, Ks, Vs, j0, end, kv_stride2, kvh, hd2, tid);
      else
        load_tile<1>(kc, vc, Ks, Vs, j0, end, kv_stride2, kvh, hd2, tid);
      __syncthreads();
      if (j0 > warp_max_pos) continue;  // every row of this warp is before this tile (causal)

      // Scores: lane owns cache rows lane and lane + 32 of the tile, for the warp's rows.
      float s[kRowsPerWarp][2];
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) s[i][0] = s[i][1] = 0.0f;
      const uint32_t* k0 = Ks + lane * (hd2 + 1);
      const uint32_t* k1 = Ks + (lane + 32) * (hd2 + 1);
      for (int c = 0; c < hd2; ++c) {
        const float2 ka = h2f(k0[c]);
        const float2 kb = h2f(k1[c]);
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const float2 qv = *reinterpret_cast<const float2*>(Qs + (warp + kWarps * i) * hd + 2 * c);
          s[i][0] = fmaf(qv.x, ka.x, fmaf(qv.y, ka.y, s[i][0]));
          s[i][1] = fmaf(qv.x, kb.x, fmaf(qv.y, kb.y, s[i][1]));
        }
      }
      // Online softmax per row (log2 domain).
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int64_t j = j0 + lane + 32 * jj;
          if (j > pos[i] || j >= end) s[i][jj] = -CUDART_INF_F;
        }
        const float m_new = fmaxf(m[i], warp_max(fmaxf(s[i][0], s[i][1])));
        float p0 = 0.0f, p1 = 0.0f, alpha = 1.0f;
        if (m_new != -CUDART_INF_F) {
          p0 = exp2f(s[i][0] - m_new);
          p1 = exp2f(s[i][1] - m_new);
          alpha = exp2f(m[i] - m_new);
        }
        l[i] = l[i] * alpha + warp_sum(p0 + p1);
        m[i] = m_new;
#pragma unroll
        for (int c = 0; c < kMaxPairsPerLane; ++c) {
          acc[i][c][0] *= alpha;
          acc[i][c][1] *= alpha;
        }
        float* prow = Ps + (warp + kWarps * i) * kT;
        prow[lane] = p0;
        prow[lane + 32] = p1;
      }
      __syncwarp();
      // P.V: lane owns head-dim pairs lane + 32c.
      const int tile_len = static_cast<int>(end - j0 < kT ? end - j0 : kT);
      for (int r = 0; r < tile_len; ++r) {
        float p[kRowsPerWarp];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) p[i] = Ps[(warp + kWarps * i) * kT + r];
        const uint32_t* vr = Vs + r * hd2;
#pragma unroll
        for (int c = 0; c < kMaxPairsPerLane; ++c) {
          const int cc = lane + 32 * c;
          if (cc < hd2) {
            const float2 vv = h2f(vr[cc]);
#pragma unroll
            for (int i = 0; i < kRowsPerWarp; ++i) {
              acc[i][c][0] = fmaf(p[i], vv.x, acc[i][c][0]);
              acc[i][c][1] = fmaf(p[i], vv.y, acc[i][c][1]);
            }
          }
        }
      }
      __syncwarp();  // Ps is rewritten by the next tile (of this run or the next)
    }
    ta = tb + 1;
  }

  const int64_t n_rows_all = n_tok * n_head;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t gr = r0 + warp + kWarps * i;
    if (gr >= rows_total) continue;
    const int64_t t = gr / group;
    const int64_t row = t * n_head + kvh * group + gr % group;  // output row (token, head)
    float* dst;
    float mul;
    if (gridDim.x == 1) {
      dst = out + row * hd;
      mul = 1.0f / l[i];
    } else {
      const int64_t wrow = static_cast<int64_t>(blockIdx.x) * n_rows_all + row;
      dst = ws_acc + wrow * hd;
      mul = 1.0f;
      if (lane == 0) {
        ws_ml[2 * wrow] = m[i];
        ws_ml[2 * wrow + 1] = l[i];
      }
    }
#pragma unroll
    for (int c = 0; c < kMaxPairsPerLane; ++c) {
      const int cc = lane + 32 * c;
      if (cc < hd2) {
        dst[2 * cc] = acc[i][c][0] * mul;
        dst[2 * cc + 1] = acc[i][c][1] * mul;
      }
    }
  }
}

// Merges the splits of each output row: weights 2^(m_s - M), M the largest m_s.
__global__ void attn_combine_kernel(const float* ws_acc, const float* ws_ml, int64_t n_rows_all,
                                    int32_t n_splits, int32_t hd, float* out) {
  pdl_enter();
  const int64_t row = blockIdx.x;
  float M = -CUDART_INF_F;
  for (int s = 0; s < n_splits; ++s) M = fmaxf(M, ws_ml[2 * (s * n_rows_all + row)]);
  float L = 0.0f;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = ws_ml[2 * (s * n_rows_all + row)];
    if (ms != -CUDART_INF_F) L += ws_ml[2 * (s * n_rows_all + row) + 1] * exp2f(ms - M);
  }
  const float inv = 1.0f / L;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
      const float ms = ws_ml[2 * (s * n_rows_all + row)];
      if (ms != -CUDART_INF_F) a += ws_acc[(s * n_rows_all + row) * hd + d] * exp2f(ms - M);
    }
    out[row * hd + d] = a * inv;
  }
}

// ---- prompt rows on tensor cores (compute capability >= 8.0) ---------------------------------
//
// FlashAttention-2's forward (Dao, arXiv:2307.08691) with mma.sync m16n8k16 (f16 inputs, f32
// accumulators): a block of kPfWarps warps takes kPfRows query rows of one KV head (rows are
// (token, query head) pairs of that head's group, token-major, as in attention_kernel, so the
// group's heads share every K/V tile load), warp w the 16 rows 16w..16w+15. K/V tiles of BC
// cache rows are copied global -> shared with cp.async, the next tile while the current one is
// multiplied. Per tile a warp computes S = Q K^T (16 x BC, f32), masks it causally, updates its
// rows' running max m and sum l (log2 domain: q carries scale * log2(e)), rescales its output
// accumulators, rounds P to f16 and accumulates P V. Q is rounded to f16 once (with its scale),
// P per tile: the f16 rounding of the operands is this kernel's only difference from the f32
// kernel above (measured NMSE against the double reference: tests/gpu/test_gpu_ops.cpp).
// Tiles start at position 0 in steps of BC whatever the step; a tile that is fully masked for a
// row (past its position, or another sequence's run) leaves that row's m, l and accumulators bit
// for bit as they were (scores -inf: max unchanged, alpha = 1, p = 0, and zero-filled rows past
// the run's end), and a warp skips tiles past all of its rows; so a row's bits depend on its
// sequence, position and head only, never on the tokens that share its block (issue 19).
constexpr int kPfWarps = 4;
constexpr int kPfRows = 16 * kPfWarps;  // query rows per block

constexpr int pf_tile(int hd) { return hd <= 128 ? 64 : 32; }  // K/V rows per tile
// Shared memory in bytes: Q [kPfRows][hd + 8] f16, then K and V, two tiles each, [BC][hd + 8]
// (8 halves of padding: the eight 16-byte rows an ldmatrix reads fall in different banks).
constexpr size_t pf_smem_bytes(int hd) {
  return static_cast<size_t>(kPfRows + 4 * pf_tile(hd)) * (hd + 8) * 2;
}

// kWg (head dims up to 128, sm_90a code only): S = Q K^T on wgmma (m64n64k16, Q's fragments
// from registers, the K tile from shared memory in wgmma's core-matrix layout: 8 cache rows x 8
// halves per 128 contiguous bytes, chunk c of 8 head dims at c * BC * 16 bytes), issued by the
// whole block (one warpgroup) for every tile up to the block's last position; softmax and P V
// stay per warp on mma.sync as above. An experiment against mma.sync (BERTH_ATTN_WGMMA=1).
template <int HD, bool kWg>
__global__ void __launch_bounds__(kPfWarps * 32)
    attention_prefill_mma_kernel(const float* __restrict__ q, const __half* __restrict__ k_cache,
                                 const __half* __restrict__ v_cache,
                                 const int32_t* __restrict__ positions,
                                 const int32_t* __restrict__ seqs, int64_t n_tok, int64_t n_ctx,
                                 int32_t n_head, int32_t n_head_kv, float q_scale,
                                 float* __restrict__ out) {
  pdl_enter();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kWg) return;  // never chosen where this code runs (attn_wgmma_code_loaded)
#endif
  static_assert(!kWg || HD <= 128, "the wgmma variant takes tiles of 64 cache rows");
  constexpr int BC = pf_tile(HD);
  constexpr int STR = HD + 8;  // halves per shared row
  constexpr int NT = BC / 8;   // score tiles of 8 columns
  constexpr int KD = HD / 16;  // k steps over the head dim
  constexpr int DT = HD / 8;   // output tiles of 8 columns
  constexpr bool kQInRegs = HD <= 128;
  constexpr int kThr = kPfWarps * 32;
  extern __shared__ float4 smem4[];
  __half* Qs = reinterpret_cast<__half*>(smem4);
  __half* Ks = Qs + kPfRows * STR;  // [2][BC][STR]
  __half* Vs = Ks + 2 * BC * STR;   // [2][BC][STR]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;  // fragment row and column pair
  const int32_t group = n_head / n_head_kv;
  const int32_t kvh = static_cast<int32_t>(blockIdx.z);
  const int64_t rows_total = n_tok * group;
  // Blocks of later tokens (longer KV ranges) are dispatched first.
  const int64_t r0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kPfRows;
  const int64_t q_stride = static_cast<int64_t>(n_head) * HD;
  const int64_t kv_stride = static_cast<int64_t>(n_head_kv) * HD;

  for (int i = tid; i < kPfRows * HD / 2; i += kThr) {
    const int lr = i / (HD / 2), d = (i % (HD / 2)) * 2;
    const int64_t gr = r0 + lr;
    float2 x = make_float2(0.0f, 0.0f);
    if (gr < rows_total) {
      const int64_t t = gr / group;
      const int32_t h = kvh * group + static_cast<int32_t>(gr % group);
      x = *reinterpret_cast<const float2*>(q + t * q_stride + static_cast<int64_t>(h) * HD + d);
    }
    *reinterpret_cast<__half2*>(Qs + lr * STR + d) =
        __floats2half2_rn(x.x * q_scale, x.y * q_scale);
  }
  __syncthreads();
  const uint32_t q_base =
      smem_addr(Qs + (16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8) * STR + (lane >> 4) * 8);
  uint32_t qf[kQInRegs ? KD : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KD; ++kk)
      ldsm_x4(q_base + kk * 32, qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  }

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F}, l[2] = {0.0f, 0.0f};  // rows g and g + 8

  const int64_t gr_last = (r0 + kPfRows < rows_total ? r0 + kPfRows : rows_total) - 1;
  const int64_t t_last = gr_last / group;
  // The block's tokens form runs of one sequence; each run streams its own sequence's rows.
  for (int64_t ta = r0 / group; ta <= t_last;) {
    const int32_t sq = seqs ? seqs[ta] : 0;
    int64_t ext = 0;
    const int64_t tb = seq_run_end(positions, seqs, ta, t_last, ext);
    int64_t pos[2];
    int64_t my_max = -1;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      pos[hr] = run_row_pos(positions, r0 + 16 * warp + g + 8 * hr, rows_total, group, ta, tb);
      if (pos[hr] > my_max) my_max = pos[hr];
    }
    int warp_max_pos = static_cast<int>(my_max);
    for (int o2 = 16; o2 > 0; o2 >>= 1)
      warp_max_pos = max(warp_max_pos, __shfl_xor_sync(0xffffffffu, warp_max_pos, o2));
    __shared__ int warp_max[kPfWarps];
    if (lane == 0) warp_max[warp] = warp_max_pos;
    int64_t n_kv = ext + 1;
    if (n_kv > n_ctx) n_kv = n_ctx;
    const int64_t base = static_cast<int64_t>(sq < 0 ? 0 : sq) * n_ctx;
    const __half* kc = k_cache + base * kv_stride + static_cast<int64_t>(kvh) * HD;
    const __half* vc = v_cache + base * kv_stride + static_cast<int64_t>(kvh) * HD;
    const int64_t n_tiles = (n_kv + BC - 1) / BC;

    const auto load = [&](int64_t tile, int buf) {
      const int64_t j0 = tile * BC;
      __half* kd = Ks + buf * BC * STR;
      __half* vd = Vs + buf * BC * STR;
#pragma unroll
      for (int c = tid; c < BC * HD / 8; c += kThr) {
        const int r = c / (HD / 8), col = (c % (HD / 8)) * 8;
        const int64_t j = j0 + r;
        const bool valid = j < n_kv;
        const int64_t off = (valid ? j : 0) * kv_stride + col;
        if constexpr (kWg) {
          // Core-matrix layout: lane pairs read 32 contiguous bytes of a row.
          const int rk = (c >> 1) % BC, ck = 2 * ((c >> 1) / BC) + (c & 1);
          const int64_t jk = j0 + rk;
          const bool vk = jk < n_kv;
          cp_async16(smem_addr(kd + ck * BC * 8 + rk * 8), kc + (vk ? jk : 0) * kv_stride + ck * 8,
                     vk);
        } else {
          cp_async16(smem_addr(kd + r * STR + col), kc + off, valid);
        }
        cp_async16(smem_addr(vd + r * STR + col), vc + off, valid);
      }
      cp_async_commit();
    };

    __syncthreads();  // the previous run's last tile is consumed
    int block_max_pos = warp_max[0];
#pragma unroll
    for (int w = 1; w < kPfWarps; ++w) block_max_pos = max(block_max_pos, warp_max[w]);
    load(0, 0);
    for (int64_t it = 0; it < n_tiles; ++it) {
      if (it + 1 < n_tiles) {
        load(it + 1, static_cast<int>((it + 1) & 1));
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      if constexpr (kWg) fence_proxy_async();
#endif
      __syncthreads();
      const int64_t j0 = it * BC;
      const int buf = static_cast<int>(it & 1);
      float s[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      if constexpr (kWg) {
        if (j0 <= block_max_pos) {  // uniform over the block: its one warpgroup issues it
          static_assert(NT * 4 == 32, "m64n64 accumulators");
          float* sd = &s[0][0];
          const uint32_t kb = smem_addr(Ks + buf * BC * STR);
          wg_pin<32>(sd);
          wg_fence();
#pragma unroll
          for (int kk = 0; kk < KD; ++kk)
            wg_rs_m64n64k16(sd, qf[kk], wg_desc(kb + 2 * kk * BC * 16, BC * 16, 128));
          wg_commit();
          wg_wait0();
          wg_pin<32>(sd);
        }
      }
#endif
      if (j0 <= warp_max_pos) {
        const uint32_t k_base = smem_addr(
            Ks + buf * BC * STR + ((lane >> 4) * 8 + (lane & 7)) * STR + ((lane >> 3) & 1) * 8);
        const uint32_t v_base = smem_addr(
            Vs + buf * BC * STR + (((lane >> 3) & 1) * 8 + (lane & 7)) * STR + (lane >> 4) * 8);
        if constexpr (!kWg) {
#pragma unroll
          for (int kk = 0; kk < KD; ++kk) {
            uint32_t a[4];
            if constexpr (kQInRegs) {
              a[0] = qf[kk][0], a[1] = qf[kk][1], a[2] = qf[kk][2], a[3] = qf[kk][3];
            } else {
              ldsm_x4(q_base + kk * 32, a[0], a[1], a[2], a[3]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
              uint32_t b0, b1, b2, b3;
              ldsm_x4(k_base + (nt * 8 * STR + kk * 16) * 2, b0, b1, b2, b3);
              mma_f16(s[nt], a, b0, b1);
              mma_f16(s[nt + 1], a, b2, b3);
            }
          }
        }
        // Causal mask and the online softmax of rows g (hr 0) and g + 8 (hr 1).
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -CUDART_INF_F;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int64_t j = j0 + nt * 8 + 2 * tq + e;
              if (j > pos[hr]) s[nt][2 * hr + e] = -CUDART_INF_F;
              mx = fmaxf(mx, s[nt][2 * hr + e]);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m[hr], mx);
          float alpha = 1.0f, rs = 0.0f;
          if (m_new != -CUDART_INF_F) {
            alpha = exp2f(m[hr] - m_new);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float p = exp2f(s[nt][2 * hr + e] - m_new);
                s[nt][2 * hr + e] = p;
                rs += p;
              }
          } else {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][2 * hr] = s[nt][2 * hr + 1] = 0.0f;
          }
          l[hr] = l[hr] * alpha + rs;  // this thread's columns; the quad sums at the end
          m[hr] = m_new;
#pragma unroll
          for (int dt = 0; dt < DT; ++dt) {
            o[dt][2 * hr] *= alpha;
            o[dt][2 * hr + 1] *= alpha;
          }
        }
        // O += P V: the score accumulators are P's A fragments (two score tiles per k step).
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
          const uint32_t a[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]),
                                 pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                 pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                 pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
          for (int dt = 0; dt < DT; dt += 2) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4<true>(v_base + (kk * 16 * STR + dt * 8) * 2, b0, b1, b2, b3);
            mma_f16(o[dt], a, b0, b1);
            mma_f16(o[dt + 1], a, b2, b3);
          }
        }
      }
      __syncthreads();  // the tile's buffer is refilled two tiles on
    }
    ta = tb + 1;
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lsum = l[hr];
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 1);
    lsum += __shfl_xor_sync(0xffffffffu, lsum, 2);
    const int64_t gr = r0 + 16 * warp + g + 8 * hr;
    if (gr >= rows_total) continue;
    const int64_t t = gr / group;
    const int32_t h = kvh * group + static_cast<int32_t>(gr % group);
    float* dst = out + t * q_stride + static_cast<int64_t>(h) * HD;
    const float inv = 1.0f / lsum;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8 + 2 * tq) =
          make_float2(o[dt][2 * hr] * inv, o[dt][2 * hr + 1] * inv);
  }
#endif
}

using PrefillKernel = void (*)(const float*, const __half*, const __half*, const int32_t*,
                               const int32_t*, int64_t, int64_t, int32_t, int32_t, float, float*);
// This file's sm_90a probe (wgmma.cuh).
bool attn_wgmma_code_loaded() { return sm90a_code_loaded<2>(); }

// The instance for a head dim, or null (the f32 kernel serves it); `wg`: the wgmma variant
// (head dims 64 and 128).
PrefillKernel prefill_kernel_for(int32_t head_dim, bool wg = false) {
  switch (head_dim) {
    case 64:
      return wg ? attention_prefill_mma_kernel<64, true> : attention_prefill_mma_kernel<64, false>;
    case 128:
      return wg ? attention_prefill_mma_kernel<128, true>
                : attention_prefill_mma_kernel<128, false>;
    case 256:
      return attention_prefill_mma_kernel<256, false>;
    default:
      return nullptr;
  }
}

// ---- decode (one query token), thread block clusters (compute capability >= 9.0) ----------
//
// Clusters of kDecCluster blocks per (KV head, subgroup of at most GM of its query heads): the
// cache rows [0, position + 1) are cut into slabs of 32 / GM rows, dealt round-robin to the warps
// of the active clusters (below). A warp keeps q of its heads and their accumulators in
// registers (lane owns head-dim pairs lane + 32 i, i < PL); per slab it loads all K and V words
// first (one memory latency per slab), then sums the slab's 32 partial scores (rows x heads)
// over the warp in one transposing butterfly (31 shuffles; lane L ends with the score of row
// L / GM, head L % GM), so each lane takes one exp2 and the running max and sum of one head. The
// warps' partials merge in shared memory, then the blocks' partials across the cluster through
// distributed shared memory, in a fixed order (the same bits on every replay). The new token's
// own row is read from k/v (rounded to f16 exactly as the cache stores it) and written to the
// cache by the warp that reads it, so the decode step needs neither kv_write_kernel nor the
// general kernel's split combine.
//
// Split over the KV range: each (token, KV head, subgroup) has n_clust clusters of cb blocks
// (decode_plan: a function of n_ctx, the head shape, the switches and the device), of which the
// first `active` take part at this position (dec_active: one per 2 slabs per warp of a cluster,
// so a short context keeps one cluster). With one active cluster, that cluster writes the output
// (and its 8-bit blocks); with more, each writes its merged (m, l, unnormalised acc) to the
// workspace and attn_dec_combine_kernel merges them in cluster order. A row's bits depend on its
// position, n_ctx and the head shape, never on the other tokens of the step.
constexpr int kDecCluster = 8;       // blocks per cluster of an unsplit KV range (portable size)
constexpr int kDecSplitCluster = 2;  // blocks per cluster when the KV range is split
constexpr int kDecMinSlabs = 2;      // slabs per warp before another cluster becomes active
constexpr int kDecMaxClusters = 64;

// Dynamic shared memory of the decode kernel with W warps and GM heads per block, in floats:
// per warp GM x (m, l) and GM x hd accumulators, then the block's merged ones.
constexpr size_t dec_smem_floats(int w, int gm, int hd) {
  return static_cast<size_t>(w + 1) * gm * (hd + 2);
}

// Clusters that take part for a token whose cache holds n_kv rows, of n_clust, when one pass of
// a cluster covers `pass_rows` rows (kDecCluster * W warps of one slab each).
__host__ __device__ __forceinline__ int64_t dec_active(int64_t n_kv, int64_t n_clust,
                                                       int64_t pass_rows) {
  const int64_t per = pass_rows * kDecMinSlabs;
  const int64_t a = (n_kv + per - 1) / per;
  return a < 1 ? 1 : (a > n_clust ? n_clust : a);
}

// Floats of one (token, KV head, subgroup, cluster) partial in the workspace: GM x (m, l), then
// GM x hd accumulators.
constexpr int64_t dec_partial_floats(int gm, int hd) { return static_cast<int64_t>(gm) * (hd + 2); }

// One butterfly step of the transposing warp sum: 2N values per lane -> N; lanes with bit N
// set keep the upper half. After the steps for N = 16, 8, 4, 2, 1, v[0] of lane L is the sum
// over the warp of value L.
template <int N>
__device__ __forceinline__ void transpose_sum_step(float* v, int lane) {
  const bool up = (lane & N) != 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = up ? v[i] : v[i + N];
    const float keep = up ? v[i + N] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, N);
  }
}

// Grid: (cb, n_head_kv, tokens * subgroups * n_clust) in clusters of cb blocks along x, blockIdx.z
// = (token * subgroups + subgroup) * n_clust + cluster. ws: the partials of the launch's tokens
// (n_clust > 1), at
// ((token * n_head_kv + KV head) * subgroups + subgroup) * n_clust + cluster, each
// dec_partial_floats(GM, hd).
template <int PL, int W, int GM>
__global__ void __launch_bounds__(W * 32, 1)
    attention_decode_kernel(const float* __restrict__ q, const float* __restrict__ k_new,
                            const float* __restrict__ v_new, const int32_t* __restrict__ positions,
                            const int32_t* __restrict__ seqs, uint32_t* __restrict__ k_cache,
                            uint32_t* __restrict__ v_cache, int64_t n_ctx, int32_t n_head,
                            int32_t n_head_kv, int32_t hd, float q_scale, float* __restrict__ out,
                            int8_t* __restrict__ q8, float4* __restrict__ q8m, int32_t n_clust,
                            float* __restrict__ ws) {
  pdl_enter();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kSlab = 32 / GM;  // cache rows per warp step
  static_assert(kSlab * GM == 32, "a slab's scores are one per lane");
  constexpr int kThr = W * 32;
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ float4 smem4[];
  float* w_ml = reinterpret_cast<float*>(smem4);  // [W][GM][2]
  float* w_acc = w_ml + W * GM * 2;               // [W][GM][hd]
  float* b_ml = w_acc + W * GM * hd;              // [GM][2]
  float* b_acc = b_ml + GM * 2;                   // [GM][hd]

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int rank = static_cast<int>(cluster.block_rank());
  const int32_t group = n_head / n_head_kv;
  const int32_t kvh = static_cast<int32_t>(blockIdx.y);
  // Each decode token (of its own sequence) is computed exactly as a one-token call computes it.
  const int32_t n_sub = (group + GM - 1) / GM;
  const int64_t cz = blockIdx.z / n_clust;  // token * subgroups + subgroup
  const int64_t tok = cz / n_sub;
  const int32_t sub = static_cast<int32_t>(cz % n_sub);
  const int64_t clu = blockIdx.z % n_clust;
  const int32_t g0 = sub * GM;
  const int ng = group - g0 < GM ? group - g0 : GM;
  const int hd2 = hd / 2;
  const int64_t kv_stride2 = static_cast<int64_t>(n_head_kv) * hd2;
  const int64_t p = positions[tok];
  int64_t n_kv = p + 1;
  if (n_kv > n_ctx) n_kv = n_ctx;
  const int cb = static_cast<int>(gridDim.x);  // blocks per cluster
  const int64_t active = dec_active(n_kv, n_clust, static_cast<int64_t>(cb) * W * kSlab);
  if (clu >= active) return;  // the whole cluster: no cluster.sync waits for it
  {
    const int64_t sq = seqs ? seqs[tok] : 0;
    const int64_t base = (sq < 0 ? 0 : sq) * n_ctx * kv_stride2;  // the sequence's first row
    k_cache += base;
    v_cache += base;
  }
  q += tok * n_head * hd;
  k_new += tok * n_head_kv * hd;
  v_new += tok * n_head_kv * hd;
  out += tok * n_head * hd;
  if (q8) {
    q8 += tok * n_head * hd;
    q8m += tok * n_head * hd / 32;
  }
  const int my_g = lane % GM, my_r = lane / GM;  // the score this lane ends a slab with

  float2 qv[GM][PL];
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      qv[g][i] = make_float2(0.0f, 0.0f);
      if (g < ng && c < hd2) {
        const float2 x = *reinterpret_cast<const float2*>(
            q + static_cast<int64_t>(kvh * group + g0 + g) * hd + 2 * c);
        qv[g][i] = make_float2(x.x * q_scale, x.y * q_scale);
      }
    }
  float m_run = -CUDART_INF_F, l_run = 0.0f;  // of head my_g (the same in its kSlab lanes)
  float2 acc[GM][PL];
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int i = 0; i < PL; ++i) acc[g][i] = make_float2(0.0f, 0.0f);

  const uint32_t* kc = k_cache + static_cast<int64_t>(kvh) * hd2;
  const uint32_t* vc = v_cache + static_cast<int64_t>(kvh) * hd2;
  const int64_t n_slabs = (n_kv + kSlab - 1) / kSlab;
  const int64_t stride = active * cb * W;
  for (int64_t sl = (clu * cb + rank) * W + warp; sl < n_slabs; sl += stride) {
    const int64_t j0 = sl * kSlab;
    uint32_t kw[kSlab][PL], vw[kSlab][PL];
#pragma unroll
    for (int r = 0; r < kSlab; ++r)
#pragma unroll
      for (int i = 0; i < PL; ++i) {
        const int c = lane + 32 * i;
        const int64_t j = j0 + r;
        kw[r][i] = vw[r][i] = 0u;
        if (j < n_kv && c < hd2 && j != p) {
          kw[r][i] = kc[j * kv_stride2 + c];
          vw[r][i] = vc[j * kv_stride2 + c];
        }
      }
    if (p >= j0 && p < j0 + kSlab && p < n_kv) {
      // This token's row: from k/v, rounded as the cache stores it; subgroup 0 writes it.
#pragma unroll
      for (int r = 0; r < kSlab; ++r) {
        if (j0 + r != p) continue;
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          const int c = lane + 32 * i;
          if (c < hd2) {
            const int64_t src = static_cast<int64_t>(kvh) * hd + 2 * c;
            const __half2 kh = __floats2half2_rn(k_new[src], k_new[src + 1]);
            const __half2 vh = __floats2half2_rn(v_new[src], v_new[src + 1]);
            memcpy(&kw[r][i], &kh, 4);
            memcpy(&vw[r][i], &vh, 4);
            if (sub == 0) {
              k_cache[p * kv_stride2 + static_cast<int64_t>(kvh) * hd2 + c] = kw[r][i];
              v_cache[p * kv_stride2 + static_cast<int64_t>(kvh) * hd2 + c] = vw[r][i];
            }
          }
        }
      }
    }
    // Partial scores (row r, head g) -> value r * GM + g; the warp sum leaves value L in lane L.
    float v[32];
#pragma unroll
    for (int r = 0; r < kSlab; ++r)
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float x = 0.0f;
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          const float2 kf = h2f(kw[r][i]);
          x = fmaf(qv[g][i].x, kf.x, fmaf(qv[g][i].y, kf.y, x));
        }
        v[r * GM + g] = x;
      }
    transpose_sum_step<16>(v, lane);
    transpose_sum_step<8>(v, lane);
    transpose_sum_step<4>(v, lane);
    transpose_sum_step<2>(v, lane);
    transpose_sum_step<1>(v, lane);
    // Online softmax of head my_g over the slab's rows (lanes my_g, my_g + GM, ...).
    const bool valid = j0 + my_r < n_kv && my_g < ng;
    const float s = valid ? v[0] : -CUDART_INF_F;
    float smax = s;
#pragma unroll
    for (int o = GM; o < 32; o <<= 1) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
    const float m_new = fmaxf(m_run, smax);
    float alpha = 1.0f, pr = 0.0f;
    if (m_new != -CUDART_INF_F) {  // a head past ng stays at -inf
      alpha = exp2f(m_run - m_new);
      pr = valid ? exp2f(s - m_new) : 0.0f;
    }
    float psum = pr;
#pragma unroll
    for (int o = GM; o < 32; o <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
    l_run = l_run * alpha + psum;
    m_run = m_new;
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      const float a = __shfl_sync(0xffffffffu, alpha, g);  // lane g: head g
#pragma unroll
      for (int i = 0; i < PL; ++i) acc[g][i] = make_float2(acc[g][i].x * a, acc[g][i].y * a);
    }
#pragma unroll
    for (int r = 0; r < kSlab; ++r)
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float prg = __shfl_sync(0xffffffffu, pr, r * GM + g);
#pragma unroll
        for (int i = 0; i < PL; ++i) {
          const float2 vf = h2f(vw[r][i]);
          acc[g][i].x = fmaf(prg, vf.x, acc[g][i].x);
          acc[g][i].y = fmaf(prg, vf.y, acc[g][i].y);
        }
      }
  }

  // The warps' partials -> shared memory; the block's merge (warps in order).
  if (lane < GM) {
    w_ml[(warp * GM + lane) * 2] = m_run;
    w_ml[(warp * GM + lane) * 2 + 1] = l_run;
  }
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int i = 0; i < PL; ++i) {
      const int c = lane + 32 * i;
      if (c < hd2) {
        w_acc[(warp * GM + g) * hd + 2 * c] = acc[g][i].x;
        w_acc[(warp * GM + g) * hd + 2 * c + 1] = acc[g][i].y;
      }
    }
  __syncthreads();
  for (int o = tid; o < ng * hd; o += kThr) {
    const int g = o / hd, d = o % hd;
    float M = -CUDART_INF_F;
    for (int w = 0; w < W; ++w) M = fmaxf(M, w_ml[(w * GM + g) * 2]);
    float L = 0.0f, a = 0.0f;
    if (M != -CUDART_INF_F)
      for (int w = 0; w < W; ++w) {
        const float mw = w_ml[(w * GM + g) * 2];
        if (mw == -CUDART_INF_F) continue;
        const float e = exp2f(mw - M);
        L += w_ml[(w * GM + g) * 2 + 1] * e;
        a += w_acc[(w * GM + g) * hd + d] * e;
      }
    b_acc[g * hd + d] = a;
    if (d == 0) {
      b_ml[g * 2] = M;
      b_ml[g * 2 + 1] = L;
    }
  }
  cluster.sync();  // every block's merge is complete and visible to the cluster
  // The blocks' partials (in rank order) -> out, or -> this cluster's partial in the workspace
  // (more than one active cluster); each block writes a share.
  float* part = active > 1 ? ws + (((tok * n_head_kv + kvh) * n_sub + sub) * n_clust + clu) *
                                      dec_partial_floats(GM, hd)
                           : nullptr;
  for (int o = rank * kThr + tid; o < ng * hd; o += cb * kThr) {
    const int g = o / hd, d = o % hd;
    float M = -CUDART_INF_F;
    for (int b = 0; b < cb; ++b) M = fmaxf(M, cluster.map_shared_rank(b_ml, b)[g * 2]);
    float L = 0.0f, a = 0.0f;
    for (int b = 0; b < cb; ++b) {
      const float* ml = cluster.map_shared_rank(b_ml, b);
      const float mb = ml[g * 2];
      if (mb == -CUDART_INF_F) continue;
      const float e = exp2f(mb - M);
      L += ml[g * 2 + 1] * e;
      a += cluster.map_shared_rank(b_acc, b)[g * hd + d] * e;
    }
    if (part) {
      part[GM * 2 + g * hd + d] = a;
      if (d == 0) {
        part[g * 2] = M;
        part[g * 2 + 1] = L;
      }
      continue;
    }
    const int64_t idx = static_cast<int64_t>(kvh * group + g0 + g) * hd + d;
    const float y = a / L;
    out[idx] = y;
    // The 8-bit blocks of the output (hd % 32 == 0: a warp's 32 outputs are one block).
    if (q8) quantize_group(y, lane, q8 + (idx - lane), q8m + idx / 32);
  }
  cluster.sync();  // no block leaves while another may still read its shared memory
#endif
}

// Merges the active clusters' partials of each decode output row (token, query head), in cluster
// order, when more than one took part (otherwise the decode kernel wrote the row). Grid: one
// block per (token, head), blockIdx.x = token * n_head + head; blockDim.x = hd rounded up to 32.
// ws and the arguments as the decode launch's (tokens from its first, in blockIdx.z order).
template <int GM>
__global__ void attn_dec_combine_kernel(const float* __restrict__ ws,
                                        const int32_t* __restrict__ positions, int64_t n_ctx,
                                        int32_t n_head, int32_t n_head_kv, int32_t hd,
                                        int32_t n_clust, int64_t pass_rows, float* __restrict__ out,
                                        int8_t* __restrict__ q8, float4* __restrict__ q8m) {
  pdl_enter();
  const int64_t tok = blockIdx.x / n_head;
  const int32_t h = static_cast<int32_t>(blockIdx.x % n_head);
  int64_t n_kv = positions[tok] + 1;
  if (n_kv > n_ctx) n_kv = n_ctx;
  const int64_t active = dec_active(n_kv, n_clust, pass_rows);
  if (active <= 1) return;
  const int32_t group = n_head / n_head_kv;
  const int32_t n_sub = (group + GM - 1) / GM;
  const int32_t kvh = h / group, sub = (h % group) / GM, g = (h % group) % GM;
  const int64_t z0 = ((tok * n_head_kv + kvh) * n_sub + sub) * n_clust;  // first cluster's part
  const int64_t pf = dec_partial_floats(GM, hd);
  const int d = static_cast<int>(threadIdx.x);
  float M = -CUDART_INF_F;
  for (int64_t c = 0; c < active; ++c) M = fmaxf(M, ws[(z0 + c) * pf + g * 2]);
  float L = 0.0f, a = 0.0f;
  for (int64_t c = 0; c < active; ++c) {
    const float* part = ws + (z0 + c) * pf;
    const float mc = part[g * 2];
    if (mc == -CUDART_INF_F) continue;
    const float e = exp2f(mc - M);
    L += part[g * 2 + 1] * e;
    if (d < hd) a += part[GM * 2 + g * hd + d] * e;
  }
  if (d >= hd) return;
  const int64_t idx = (tok * n_head + h) * hd + d;
  const float y = a / L;
  out[idx] = y;
  if (q8) quantize_group(y, d % 32, q8 + (idx - d % 32), q8m + idx / 32);
}

// The decode kernel instance for a head dim <= 256 (attention() checks it), GM query heads per
// block and W warps: pairs per lane from the head dim; 16 warps by default (<= 128 registers per
// thread), 8 for head_dim 256 (PL 4, only with GM 4).
using DecodeKernel = void (*)(const float*, const float*, const float*, const int32_t*,
                              const int32_t*, uint32_t*, uint32_t*, int64_t, int32_t, int32_t,
                              int32_t, float, float*, int8_t*, float4*, int32_t, float*);
using DecCombineKernel = void (*)(const float*, const int32_t*, int64_t, int32_t, int32_t, int32_t,
                                  int32_t, int64_t, float*, int8_t*, float4*);
struct DecodeChoice {
  DecodeKernel kernel;
  DecCombineKernel combine;
  int warps;
  int gm;
};
template <int GM>
DecodeChoice decode_instance(int pl, int warps) {
  constexpr DecCombineKernel c = attn_dec_combine_kernel<GM>;
  if (warps == 8) {
    if (pl == 1) return {attention_decode_kernel<1, 8, GM>, c, 8, GM};
    return {attention_decode_kernel<2, 8, GM>, c, 8, GM};
  }
  if (pl == 1) return {attention_decode_kernel<1, 16, GM>, c, 16, GM};
  return {attention_decode_kernel<2, 16, GM>, c, 16, GM};
}
// gm 4 or 8 (8 only for head_dim <= 128), warps 0 (16; 8 for head_dim 256), 8 or 16.
DecodeChoice decode_kernel_for(int32_t head_dim, int gm, int warps) {
  if (head_dim > 128) return {attention_decode_kernel<4, 8, 4>, attn_dec_combine_kernel<4>, 8, 4};
  const int pl = head_dim <= 64 ? 1 : 2;
  if (warps == 0) warps = 16;
  return gm == 8 ? decode_instance<8>(pl, warps) : decode_instance<4>(pl, warps);
}

}  // namespace

namespace detail {
bool& attention_cluster_decode() {
  static bool v = !env_says_off("BERTH_ATTN_CLUSTER");
  return v;
}
int& attention_decode_heads() {
  static int v = env_choice("BERTH_ATTN_DEC_HEADS", {0, 4, 8});
  return v;
}
int& attention_decode_warps() {
  static int v = env_choice("BERTH_ATTN_DEC_WARPS", {0, 8, 16});
  return v;
}
int& attention_decode_cluster_blocks() {
  static int v = env_choice("BERTH_ATTN_DEC_CB", {0, 1, 2, 4, 8});
  return v;
}
int& attention_decode_clusters() {
  static int v = static_cast<int>(env_uint("BERTH_ATTN_DEC_CLUSTERS", kDecMaxClusters).value_or(0));
  return v;
}
bool& attention_prefill_mma() {
  static bool v = !env_says_off("BERTH_ATTN_MMA");
  return v;
}
bool& attention_prefill_wgmma() {
  static bool v = env_says_on("BERTH_ATTN_WGMMA");
  return v;
}
bool attention_wgmma_runs() { return mma_kernels_available() && attn_wgmma_code_loaded(); }
bool attention_prompt_on_mma(int32_t head_dim, bool caches_aligned) {
  return caches_aligned && prefill_kernel_for(head_dim) != nullptr && attention_prefill_mma() &&
         mma_kernels_available();
}
}  // namespace detail

namespace {
// The decode rows of a call (attention's n_decode, resolved).
int64_t decode_rows(int64_t n_tok, int64_t n_decode) {
  if (n_decode < -1 || n_decode > n_tok)
    bad_arg("gpu::attention: " + std::to_string(n_decode) + " decode rows of " +
            std::to_string(n_tok));
  return n_decode >= 0 ? n_decode : (n_tok == 1 ? 1 : 0);
}
// KV splits of a decode row (the split kernel, without clusters): those of a one-token call,
// a function of n_ctx and n_head only.
int64_t decode_splits(int64_t n_ctx, int32_t n_head) { return attention_splits(1, n_ctx, n_head); }

// The cluster decode kernel's launch for a head shape and n_ctx (dec_clusters: a function of
// these, the knobs and the device, never of the step).
struct DecPlan {
  DecodeChoice dc;
  int cb;             // blocks per cluster
  int64_t n_sub;      // query-head subgroups per KV head
  int64_t n_clust;    // clusters per (token, KV head, subgroup)
  int64_t pass_rows;  // cache rows one pass of a cluster's warps covers
  size_t smem;        // dynamic shared memory bytes per block
};

// Clusters of `kernel` (blocks of `threads` threads with `smem` bytes, cb per cluster) that the
// current device runs at once; read once per (kernel, device, smem, cb).
int64_t dec_device_clusters(DecodeKernel kernel, int threads, size_t smem, int cb) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int>, int64_t> known;
  int dev = 0;
  BERTH_CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), dev, smem, cb);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(cb), 1, 1);
  cfg.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cb);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  BERTH_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
  known[key] = n;
  return n;
}

// The plan for query heads per block `gm` and blocks per cluster `cb`, n_clust unset.
DecPlan dec_shape(int32_t group, int32_t head_dim, int gm, int cb) {
  if (head_dim > 128) gm = 4;  // no 8-head instance: its registers would spill
  DecPlan p{};
  p.dc = decode_kernel_for(head_dim, gm, detail::attention_decode_warps());
  p.cb = cb;
  p.n_sub = (group + gm - 1) / gm;
  p.pass_rows = static_cast<int64_t>(cb) * p.dc.warps * (32 / gm);
  p.smem = dec_smem_floats(p.dc.warps, gm, head_dim) * sizeof(float);
  allow_dynamic_smem(p.dc.kernel, p.smem);
  return p;
}

// A cache that one cluster of 8 blocks covers with 2 slabs per warp keeps that one cluster (4
// query heads per block unless forced), and so does a split that would give a KV head fewer
// than 8 blocks in all. A longer one splits its KV range over clusters of
// kDecSplitCluster blocks (8 query heads per block where a KV head has 8 or more and head_dim
// <= 128): as many as the device runs at once for one token, never more than become active
// within n_ctx. Clusters of 2 blocks and 8 heads per block were the fastest split on the H200
// (docs/performance.md).
DecPlan decode_plan(int64_t n_ctx, int32_t n_head, int32_t n_head_kv, int32_t head_dim) {
  const int32_t group = n_head / n_head_kv;
  const int heads = detail::attention_decode_heads();
  const int forced = detail::attention_decode_clusters();
  DecPlan one = dec_shape(group, head_dim, heads != 0 ? heads : 4, kDecCluster);
  one.n_clust = 1;
  if (forced == 1 || (forced == 0 && n_ctx <= one.pass_rows * kDecMinSlabs)) return one;
  const int cbk = detail::attention_decode_cluster_blocks();
  DecPlan p = dec_shape(group, head_dim, heads != 0 ? heads : (group >= 8 ? 8 : 4),
                        cbk != 0 ? cbk : kDecSplitCluster);
  if (forced > 0) {
    p.n_clust = forced;
  } else {
    const int64_t per = p.pass_rows * kDecMinSlabs;
    const int64_t by_ctx = (n_ctx + per - 1) / per;
    const int64_t by_dev =
        dec_device_clusters(p.dc.kernel, p.dc.warps * 32, p.smem, p.cb) / (n_head_kv * p.n_sub);
    p.n_clust = std::max<int64_t>(1, std::min<int64_t>({by_ctx, by_dev, kDecMaxClusters}));
    // Fewer blocks than the one cluster of 8 (many KV heads already fill the card): keep it.
    if (p.n_clust * p.cb < kDecCluster) return one;
  }
  return p;
}

// Where the cluster decode kernel's partials start in the workspace: past the 8-bit output
// blocks (q8_ws may be the workspace itself: CudaDevice passes its matmul workspace for both).
size_t dec_partials_offset(int64_t n_tok, int64_t q_stride) {
  const auto n = static_cast<size_t>(n_tok * q_stride);
  return detail::align_up(detail::align_up(n) + n / 32 * sizeof(float4));
}

bool cluster_decode_runs() {
  return detail::attention_cluster_decode() && cluster_kernels_available();
}
}  // namespace

size_t attention_workspace_bytes(int64_t n_tok, int64_t n_ctx, int32_t n_head, int32_t n_head_kv,
                                 int32_t head_dim, int64_t n_decode) {
  const int64_t n_dec = decode_rows(n_tok, n_decode);
  if (n_dec == 0) return 0;
  size_t need = 0;
  const int64_t s = decode_splits(n_ctx, n_head);
  if (s > 1) need = static_cast<size_t>(s * n_dec * n_head * (head_dim + 2)) * sizeof(float);
  if (cluster_decode_runs() && n_head_kv > 0 && n_head % n_head_kv == 0 && head_dim >= 2 &&
      head_dim <= kMaxHeadDim && n_ctx > 0) {
    const DecPlan p = decode_plan(n_ctx, n_head, n_head_kv, head_dim);
    if (p.n_clust > 1)
      need = std::max(need, dec_partials_offset(n_tok, static_cast<int64_t>(n_head) * head_dim) +
                                static_cast<size_t>(n_dec * n_head_kv * p.n_sub * p.n_clust *
                                                    dec_partial_floats(p.dc.gm, head_dim)) *
                                    sizeof(float));
  }
  return need;
}

bool attention(const float* q, const float* k, const float* v, int64_t n_tok,
               const int32_t* positions, uint16_t* k_cache, uint16_t* v_cache, int64_t n_ctx,
               int32_t n_head, int32_t n_head_kv, int32_t head_dim, float scale, float* out,
               void* workspace, size_t workspace_bytes, cudaStream_t stream, void* q8_ws,
               const int32_t* seqs, int64_t n_decode) {
  if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv != 0)
    bad_arg("gpu::attention: n_head " + std::to_string(n_head) +
            " is not a multiple of n_head_kv " + std::to_string(n_head_kv));
  if (head_dim < 2 || head_dim > kMaxHeadDim || head_dim % 2 != 0)
    throw Error(ErrorCategory::unsupported, "gpu::attention: head_dim " + std::to_string(head_dim) +
                                                " (must be even and <= 256)");
  if (n_ctx <= 0) bad_arg("gpu::attention: n_ctx must be positive");
  if (n_tok <= 0) return false;
  const int64_t n_dec = decode_rows(n_tok, n_decode);
  const int64_t n_pre = n_tok - n_dec;
  const size_t need = attention_workspace_bytes(n_tok, n_ctx, n_head, n_head_kv, head_dim, n_dec);
  if (workspace_bytes < need)
    bad_arg("gpu::attention: workspace of " + std::to_string(workspace_bytes) + " bytes, needs " +
            std::to_string(need));
  const int64_t group = n_head / n_head_kv;
  const int64_t q_blocks = (std::max(n_pre, n_dec) * group + kQB - 1) / kQB;
  if (q_blocks > 65535) bad_arg("gpu::attention: too many query rows for one call");
  const int64_t q_stride = static_cast<int64_t>(n_head) * head_dim;
  const int64_t kv_dim = static_cast<int64_t>(n_head_kv) * head_dim;
  const bool cluster = n_dec > 0 && cluster_decode_runs();

  // K/V of the step into the cache (the cluster decode kernel writes its tokens' rows itself).
  const int64_t n_write = cluster ? n_pre : n_tok;
  if (n_write > 0) {
    const int64_t n = n_write * kv_dim;
    int64_t blocks = (n + 255) / 256;
    if (blocks > 4096) blocks = 4096;
    launch("kv_write_kernel", kv_write_kernel, static_cast<unsigned>(blocks), 256, 0, stream, k, v,
           n_write, positions, seqs, reinterpret_cast<__half*>(k_cache),
           reinterpret_cast<__half*>(v_cache), n_ctx, kv_dim);
  }

  // Head dims up to 128 fit the default 48 KiB; larger ones opt in (once per device, on the
  // first such call, which should therefore not be the first call inside a stream capture).
  if ((n_pre > 0 || (n_dec > 0 && !cluster)) && smem_words(head_dim) * 4 > 48 * 1024)
    allow_dynamic_smem(attention_kernel, smem_words(kMaxHeadDim) * 4);
  const float q_scale = scale * 1.4426950408889634f;  // log2(e): scores in the log2 domain
  // 8-byte cache loads when every row offset is a multiple of 8 bytes (head_dim % 4 == 0 and
  // 8-byte aligned cache pointers); 4-byte loads otherwise.
  const bool wide = head_dim % 4 == 0 && reinterpret_cast<uintptr_t>(k_cache) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(v_cache) % 8 == 0;
  // Rows [t0, t0 + n) with `splits` KV splits (1: the output directly; more: the workspace,
  // then the merge).
  const auto split_kernel = [&](int64_t t0, int64_t n, int64_t splits) {
    float* ws_acc = static_cast<float*>(workspace);
    float* ws_ml = splits > 1 ? ws_acc + splits * n * n_head * head_dim : nullptr;
    const dim3 grid(static_cast<unsigned>(splits),
                    static_cast<unsigned>((n * group + kQB - 1) / kQB),
                    static_cast<unsigned>(n_head_kv));
    launch("attention_kernel", attention_kernel, grid, kThreads, smem_words(head_dim) * 4, stream,
           q + t0 * q_stride, reinterpret_cast<const uint32_t*>(k_cache),
           reinterpret_cast<const uint32_t*>(v_cache), positions + t0, seqs ? seqs + t0 : nullptr,
           n, n_ctx, n_head, n_head_kv, head_dim, q_scale, wide, out + t0 * q_stride, ws_acc,
           ws_ml);
    if (splits > 1)
      launch("attn_combine_kernel", attn_combine_kernel, static_cast<unsigned>(n * n_head), 64, 0,
             stream, ws_acc, ws_ml, n * n_head, static_cast<int32_t>(splits), head_dim,
             out + t0 * q_stride);
  };

  // Prompt rows: one split (fixed tiles from position 0 whatever the step), on tensor cores
  // where the head dim has an instance and the cache rows are 16-byte aligned.
  if (n_pre > 0) {
    const bool wg = detail::attention_prefill_wgmma() && head_dim <= 128 &&
                    detail::attention_prompt_on_mma(head_dim, true) && attn_wgmma_code_loaded();
    const PrefillKernel pk = prefill_kernel_for(head_dim, wg);
    if (detail::attention_prompt_on_mma(head_dim,
                                        reinterpret_cast<uintptr_t>(k_cache) % 16 == 0 &&
                                            reinterpret_cast<uintptr_t>(v_cache) % 16 == 0)) {
      const size_t smem = pf_smem_bytes(head_dim);
      allow_dynamic_smem(pk, smem);
      const dim3 grid(1, static_cast<unsigned>((n_pre * group + kPfRows - 1) / kPfRows),
                      static_cast<unsigned>(n_head_kv));
      launch("attention_prefill_mma_kernel", pk, grid, kPfWarps * 32, smem, stream, q,
             reinterpret_cast<const __half*>(k_cache), reinterpret_cast<const __half*>(v_cache),
             positions, seqs, n_pre, n_ctx, n_head, n_head_kv, q_scale, out);
    } else {
      split_kernel(0, n_pre, 1);
    }
  }
  if (n_dec == 0) return false;
  if (!cluster) {
    split_kernel(n_pre, n_dec, decode_splits(n_ctx, n_head));
    return false;
  }
  const DecPlan dp = decode_plan(n_ctx, n_head, n_head_kv, head_dim);
  detail::QAct qa{nullptr, nullptr};
  if (q8_ws && head_dim % 32 == 0 && n_tok == 1) qa = detail::qact_at(q8_ws, 1, q_stride);
  const int64_t pf = dec_partial_floats(dp.dc.gm, head_dim);
  float* parts = nullptr;
  if (dp.n_clust > 1)
    parts = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) +
                                     dec_partials_offset(n_tok, q_stride));
  const int64_t per_launch = 65535 / (dp.n_sub * dp.n_clust);  // grid.z
  if (per_launch < 1) bad_arg("gpu::attention: too many decode clusters per token");
  for (int64_t t0 = n_pre; t0 < n_tok; t0 += per_launch) {
    const int64_t nt = std::min(per_launch, n_tok - t0);
    const dim3 grid(static_cast<unsigned>(dp.cb), static_cast<unsigned>(n_head_kv),
                    static_cast<unsigned>(nt * dp.n_sub * dp.n_clust));
    launch_in_clusters(
        "attention_decode_kernel", dp.dc.kernel, grid, dp.dc.warps * 32, dp.smem, stream,
        static_cast<unsigned>(dp.cb), q + t0 * q_stride, k + t0 * kv_dim, v + t0 * kv_dim,
        positions + t0, seqs ? seqs + t0 : nullptr, reinterpret_cast<uint32_t*>(k_cache),
        reinterpret_cast<uint32_t*>(v_cache), n_ctx, n_head, n_head_kv, head_dim, q_scale,
        out + t0 * q_stride, qa.q, qa.meta, static_cast<int32_t>(dp.n_clust),
        parts ? parts + (t0 - n_pre) * n_head_kv * dp.n_sub * dp.n_clust * pf : nullptr);
  }
  if (dp.n_clust > 1)
    launch("attn_dec_combine_kernel", dp.dc.combine, static_cast<unsigned>(n_dec * n_head),
           static_cast<unsigned>((head_dim + 31) / 32 * 32), 0, stream, parts, positions + n_pre,
           n_ctx, n_head, n_head_kv, head_dim, static_cast<int32_t>(dp.n_clust), dp.pass_rows,
           out + n_pre * q_stride, qa.q, qa.meta);
  return qa.q != nullptr;
}

}  // namespace berth::gpu
