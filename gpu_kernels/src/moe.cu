// Routed experts of a MoE layer: moe_workspace_bytes, moe_experts.
//
// Decode (n_tok <= moe_gemv_max_tok()): h is quantized once; one routed GEMV launch per matrix
// covers all n_tok * k (token, slot) pairs (grid row = pair; the expert id is read from `route`
// on the device, masked or invalid slots exit at once): gate, up, then SwiGLU fused into the
// quantization of the down input, then down; a combine kernel sums each token's slots in slot
// order. With several tokens and moe_gemv_group() (off by default: slower on an H100) the pairs
// are first listed by expert (the prefill's gather kernel, tiles of kMoeGroupTok pairs) and each
// quantized GEMV's grid row is a tile: its expert's weights are loaded once for up to
// kMoeGroupTok pairs, each pair's row summed in the same order as alone.
//
// Prefill: a one-warp kernel lists the valid pairs grouped by expert (experts ascending, pairs
// in token order within each: a stable counting sort with warp match/popc, no atomics) and
// writes per-expert offsets and 64-row tile offsets; h rows are gathered to f16 in that order;
// a grouped tensor-core GEMM (f16 in / f32 accumulate, 64-row tiles, weights dequantized into
// shared memory group by group: grouped_gemm_mma_kernel on mma.sync, or grouped_gemm_kernel on
// WMMA where that does not apply) runs gate, then up with SwiGLU in its epilogue, then down. The
// mma.sync kernel also serves matmul's invariant prompt rows as one group (dense_gemm_mma). With
// moe_gemm_int8() (an experiment, off by default) the three GEMMs run on int8 tensor cores
// instead (grouped_gemm_i8_kernel: h quantized per token, the SwiGLU output per pair row); with
// moe_gemm_wgmma() (also an experiment) the f16 kernel's multiply runs on Hopper's wgmma
// (grouped_gemm_wgmma_kernel). Both measured slower on the H200 (docs/performance.md). Its
// grid is (n_out / 64) x (an upper bound on the tile count, ceil(P / 64) + n_expert); blocks past
// the real tile count exit. The combine reads each pair's row in slot order. Everything is
// deterministic: each output element is computed by one thread in a fixed order.
//
// MoeSlots restricts both paths to a range of each token's slots. With `stage` (weights in
// pinned host memory, one token), moe_stage_kernel first copies the selected experts' matrices
// to the workspace in large coalesced reads, and the routed GEMVs address them by slot.
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <string>

#include "berth/core/error.h"
#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "launch.cuh"
#include "matmul_internal.h"
#include "mma.cuh"
#include "quant_blocks.cuh"
#include "wgmma.cuh"

namespace berth::gpu {
namespace {

using namespace detail;

constexpr int kBM = 64, kBN = 64, kBK = 32, kGemmThreads = 128;

__device__ __forceinline__ float silu_f(float z) { return z / (1.0f + __expf(-z)); }

// Which (token, slot) pairs a call computes: the expert mask and the slot range (MoeSlots).
struct PairSel {
  const uint8_t* mask;
  int n_expert;
  int sb, se;  // slots [sb, se)
};

// Expert of slot j of token t, or -1 when the slot is outside the range, invalid or masked out.
__device__ __forceinline__ int slot_expert(const float* route, int64_t t, int k, int j,
                                           const PairSel& sel) {
  if (j < sel.sb || j >= sel.se) return -1;
  const uint8_t* mask = sel.mask;
  const int n_expert = sel.n_expert;
  const float ev = route[t * 2 * k + j];
  if (!(ev >= 0.0f && ev < static_cast<float>(n_expert))) return -1;
  const int e = static_cast<int>(ev);
  if (mask && mask[e] == 0) return -1;
  return e;
}

// One warp. Outputs: expert_off / tile_off [n_expert + 1] (tiles of `tile` pairs), list [valid
// pairs] (pair ids grouped by expert), pos [P] (row of each pair in the list, -1 when skipped);
// with `groups` [P] also the tiles themselves, in order: {expert, first list entry, pairs, 0},
// then {0, 0, 0, 0} up to P (GemvRoute::groups).
__global__ void moe_gather_kernel(const float* __restrict__ route, int64_t n_tok, int k,
                                  PairSel sel, int32_t* __restrict__ expert_off,
                                  int32_t* __restrict__ tile_off, int32_t* __restrict__ list,
                                  int32_t* __restrict__ pos, int tile, int4* __restrict__ groups) {
  pdl_enter();
  extern __shared__ int32_t cnt[];
  const int lane = threadIdx.x;
  const int64_t P = n_tok * k;
  const int n_expert = sel.n_expert;
  for (int e = lane; e < n_expert; e += 32) cnt[e] = 0;
  __syncwarp();
  for (int64_t base = 0; base < P; base += 32) {
    const int64_t p = base + lane;
    const int e = p < P ? slot_expert(route, p / k, k, static_cast<int>(p % k), sel) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && lane == __ffs(same) - 1) cnt[e] += __popc(same);
    __syncwarp();
  }
  // Offsets by a warp scan over 32 experts at a time (a serial loop over 128 experts took ~20 us
  // on an H100, longer than the GEMVs it groups).
  int32_t off = 0, toff = 0;  // the experts before this chunk's
  for (int base = 0; base < n_expert; base += 32) {
    const int e = base + lane;
    const int32_t c = e < n_expert ? cnt[e] : 0;
    const int32_t nt = (c + tile - 1) / tile;
    int32_t ic = c, it = nt;  // inclusive sums over the chunk's lanes
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t uc = __shfl_up_sync(0xffffffffu, ic, o);
      const int32_t ut = __shfl_up_sync(0xffffffffu, it, o);
      if (lane >= o) ic += uc, it += ut;
    }
    const int32_t my_off = off + ic - c, my_toff = toff + it - nt;
    if (e < n_expert) {
      expert_off[e] = my_off;
      tile_off[e] = my_toff;
      cnt[e] = my_off;  // becomes the cursor
      if (groups)
        for (int32_t m = 0; m < c; m += tile)
          groups[my_toff + m / tile] = make_int4(e, my_off + m, c - m < tile ? c - m : tile, 0);
    }
    off += __shfl_sync(0xffffffffu, ic, 31);
    toff += __shfl_sync(0xffffffffu, it, 31);
  }
  if (lane == 0) {
    expert_off[n_expert] = off;
    tile_off[n_expert] = toff;
  }
  __syncwarp();
  if (groups)
    for (int64_t g = toff + lane; g < P; g += 32) groups[g] = make_int4(0, 0, 0, 0);
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t base = 0; base < P; base += 32) {
    const int64_t p = base + lane;
    const int e = p < P ? slot_expert(route, p / k, k, static_cast<int>(p % k), sel) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (p < P) {
      if (e >= 0) {
        const int32_t q = cnt[e] + __popc(same & lt);
        list[q] = static_cast<int32_t>(p);
        pos[p] = q;
      } else {
        pos[p] = -1;
      }
    }
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) cnt[e] += __popc(same);
    __syncwarp();
  }
}

struct GemmArgs {
  const uint8_t* w;
  size_t row_bytes, expert_bytes;
  int n_out, K;
  const __half* A;            // [rows, K], rows grouped by expert
  const int32_t* expert_off;  // null: one dense matrix (w) over dense_rows rows of A
  const int32_t* tile_off;
  int n_expert;
  int dense_rows;
  int mode;  // 0: C = result (f32); 1: act = f16(silu(G) * result); 2: C = silu(G) * result
  float* C;
  const float* G;
  __half* act;
  // The int8 kernel's A: rows of 8-bit activations (QAct), row m of the GEMM being row
  // a_list[m] / a_div of Aq (a_list null: row m).
  const int8_t* Aq;
  const float4* Ameta;
  const int32_t* a_list;
  int a_div;
};

// Output element o of the tile epilogues, by mode.
__device__ __forceinline__ void store_out(const GemmArgs& a, size_t o, float v) {
  if (a.mode == 0)
    a.C[o] = v;
  else if (a.mode == 1)
    a.act[o] = __float2half_rn(silu_f(a.G[o]) * v);
  else
    a.C[o] = silu_f(a.G[o]) * v;
}

// Tile `tile` of the grouped GEMM: its expert e (the last whose first tile is <= tile, by
// binary search over tile_off) and its pair rows [m0, m_end) (m_end: the expert's end; rows past
// m0 + kBM belong to the next tile). False for blocks past the real tile count. Dense calls
// (expert_off null): expert 0, rows [tile * kBM, dense_rows).
__device__ __forceinline__ bool tile_rows(const GemmArgs& a, int tile, int& e, int& m0,
                                          int& m_end) {
  if (!a.expert_off) {
    e = 0;
    m0 = tile * kBM;
    m_end = a.dense_rows;
    return m0 < m_end;
  }
  if (tile >= a.tile_off[a.n_expert]) return false;
  int lo = 0, hi = a.n_expert - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.tile_off[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  e = lo;
  m0 = a.expert_off[e] + (tile - a.tile_off[e]) * kBM;
  m_end = a.expert_off[e + 1];
  return true;
}

template <GgmlType T>
__global__ void __launch_bounds__(kGemmThreads) grouped_gemm_kernel(GemmArgs a) {
  pdl_enter();
  using namespace nvcuda;
  int e, m0, m_end;
  if (!tile_rows(a, static_cast<int>(blockIdx.y), e, m0, m_end)) return;
  const int n0 = blockIdx.x * kBN;
  const uint8_t* we = a.w + static_cast<size_t>(e) * a.expert_bytes;

  __shared__ __align__(128) __half As[kBM][kBK + 8];
  __shared__ __align__(128) __half Bs[kBN][kBK + 8];
  __shared__ __align__(128) float Cs[kBM][kBN + 4];

  const int tid = threadIdx.x, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const int brow = tid >> 1, bhalf = tid & 1;  // B: two threads per weight row
  const int bn = n0 + brow;
  const uint8_t* wrow = we + static_cast<size_t>(bn < a.n_out ? bn : 0) * a.row_bytes;

  for (int k0 = 0; k0 < a.K; k0 += kBK) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int idx = tid + i * kGemmThreads, r = idx >> 2, c = idx & 3;
      const int m = m0 + r;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (m < m_end)
        v = __ldg(reinterpret_cast<const uint4*>(a.A + static_cast<size_t>(m) * a.K + k0 + c * 8));
      *reinterpret_cast<uint4*>(&As[r][c * 8]) = v;
    }
    {
      __align__(16) __half h[16];
      if (bn < a.n_out) {
        if constexpr (is_float_type(T)) {
#pragma unroll
          for (int i = 0; i < 16; ++i)
            h[i] = __float2half_rn(float_elem<T>(wrow, k0 + 16 * bhalf + i));
        } else {
          const QGroup q = load_group<T>(wrow, k0 / 32);
#pragma unroll
          for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(group_value(q, 16 * bhalf + i));
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) h[i] = __float2half_rn(0.0f);
      }
      uint4* dst = reinterpret_cast<uint4*>(&Bs[brow][16 * bhalf]);
      dst[0] = reinterpret_cast<const uint4*>(h)[0];
      dst[1] = reinterpret_cast<const uint4*>(h)[1];
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &As[wm + 16 * i][kk], kBK + 8);
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &Bs[wn + 16 * j][kk], kBK + 8);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(&Cs[wm + 16 * i][wn + 16 * j], acc[i][j], kBN + 4,
                              wmma::mem_row_major);
  __syncthreads();
  for (int idx = tid; idx < kBM * kBN; idx += kGemmThreads) {
    const int r = idx / kBN, c = idx % kBN;
    const int m = m0 + r, n = n0 + c;
    if (m >= m_end || n >= a.n_out) continue;
    store_out(a, static_cast<size_t>(m) * a.n_out + n, Cs[r][c]);
  }
}

// The grouped GEMM on mma.sync (compute capability >= 8.0, K a multiple of 64): the same tiles
// of kBM pair rows of one expert (tile_off), kMmaBN weight rows per block, K in steps of
// kMmaBK. 8 warps, 2 x 4 over the tile (32 x 32 each). Per K step each thread decodes one
// 32-element group of one weight row (load_group/group_value, the values the WMMA kernel uses)
// into shared memory as f16, and the A rows arrive by cp.async; both are double-buffered: the
// next step's A copies and weight loads are in flight while the current step multiplies. Each
// output element is accumulated over K in ascending steps of 16 by one mma.sync chain, so its
// bits depend on its row of A and column of W only (as in grouped_gemm_kernel).
constexpr int kMmaBN = 128, kMmaBK = 64, kMmaThreads = 256, kMmaStr = kMmaBK + 8;
constexpr size_t kMmaSmem = static_cast<size_t>(2) * (kBM + kMmaBN) * kMmaStr * 2;

template <GgmlType T>
__global__ void __launch_bounds__(kMmaThreads) grouped_gemm_mma_kernel(GemmArgs a) {
  pdl_enter();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  int e, m0, m_end;
  if (!tile_rows(a, static_cast<int>(blockIdx.y), e, m0, m_end)) return;
  const int n0 = blockIdx.x * kMmaBN;
  const uint8_t* we = a.w + static_cast<size_t>(e) * a.expert_bytes;

  extern __shared__ float4 smem4[];
  __half* As = reinterpret_cast<__half*>(smem4);  // [2][kBM][kMmaStr]
  __half* Bs = As + 2 * kBM * kMmaStr;            // [2][kMmaBN][kMmaStr]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int wm = (warp >> 2) * 32, wn = (warp & 3) * 32;
  const int br = tid >> 1, bg = tid & 1;  // the weight row and 32-group this thread decodes
  const int bn = n0 + br;
  const bool b_valid = bn < a.n_out;
  const uint8_t* wrow = we + static_cast<size_t>(b_valid ? bn : 0) * a.row_bytes;
  const int n_k = a.K / kMmaBK;

  const auto load_a = [&](int kt, int buf) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kMmaThreads, r = c >> 3, col = (c & 7) * 8;
      const int m = m0 + r;
      const bool valid = m < m_end;
      const __half* src = a.A + static_cast<size_t>(valid ? m : m0) * a.K + kt * kMmaBK + col;
      cp_async16(smem_addr(As + (buf * kBM + r) * kMmaStr + col), src, valid);
    }
    cp_async_commit();
  };
  // One group of this thread's weight row as f16 into B buffer `buf`.
  const auto store_b = [&](const QGroup& q, int kt, int buf) {
    uint32_t h[16];
    if (!b_valid) {
#pragma unroll
      for (int i = 0; i < 16; ++i) h[i] = 0u;
    } else if constexpr (is_float_type(T)) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int k = kt * kMmaBK + 32 * bg + 2 * i;
        h[i] = pack_half2(float_elem<T>(wrow, k), float_elem<T>(wrow, k + 1));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        h[i] = pack_half2(group_value(q, 2 * i), group_value(q, 2 * i + 1));
    }
    uint4* dst = reinterpret_cast<uint4*>(Bs + (buf * kMmaBN + br) * kMmaStr + 32 * bg);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      dst[i] = make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
  };
  const auto fetch_b = [&](int kt) {
    QGroup q{};
    if constexpr (!is_float_type(T)) {
      if (b_valid) q = load_group<T>(wrow, kt * 2 + bg);
    }
    return q;
  };

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

  load_a(0, 0);
  store_b(fetch_b(0), 0, 0);
  cp_async_wait<0>();
  __syncthreads();
  const uint32_t a_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * kMmaStr + (lane >> 4) * 8;
  const uint32_t b_lane = ((lane >> 4) * 8 + (lane & 7)) * kMmaStr + ((lane >> 3) & 1) * 8;
  for (int kt = 0; kt < n_k; ++kt) {
    const int cur = kt & 1;
    const bool more = kt + 1 < n_k;
    QGroup qn{};
    if (more) {
      load_a(kt + 1, cur ^ 1);
      qn = fetch_b(kt + 1);
    }
    const uint32_t a_base = smem_addr(As + (cur * kBM + wm) * kMmaStr) + a_lane * 2;
    const uint32_t b_base = smem_addr(Bs + (cur * kMmaBN + wn) * kMmaStr) + b_lane * 2;
#pragma unroll
    for (int kk = 0; kk < kMmaBK / 16; ++kk) {
      uint32_t af[2][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        ldsm_x4(a_base + (16 * i * kMmaStr + 16 * kk) * 2, af[i][0], af[i][1], af[i][2], af[i][3]);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
        ldsm_x4(b_base + (16 * jp * kMmaStr + 16 * kk) * 2, bf[2 * jp][0], bf[2 * jp][1],
                bf[2 * jp + 1][0], bf[2 * jp + 1][1]);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_f16(acc[i][j], af[i], bf[j][0], bf[j][1]);
    }
    if (more) store_b(qn, kt + 1, cur ^ 1);
    cp_async_wait<0>();
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = m0 + wm + 16 * i + g + 8 * hr;
      if (m >= m_end) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = n0 + wn + 8 * j + 2 * tq;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (n + c >= a.n_out) continue;
          store_out(a, static_cast<size_t>(m) * a.n_out + n + c, acc[i][j][2 * hr + c]);
        }
      }
    }
#endif
}

// The grouped GEMM on int8 tensor cores (BERTH_MOE_INT8=1; quantized weights only; the same
// tiles, warps and double buffering as grouped_gemm_mma_kernel). A is 8-bit activations with a
// scale per 32 (QAct: d, d * the sums of each half's quants); each weight group's 32 quants
// (QGroup, unsigned or signed, all within int8) go to shared memory as they are, with its
// (sc0, sc1, m0, m1). Per 32-group, the integer dot products of mma.sync m16n8k32 (m16n8k16 per
// half for types with a scale per 16: Q2_K, Q3_K, Q6_K) are scaled into the f32 accumulator:
//     acc += d * (sc * isum) + m * (d * sum(q_x))      (per half where scales are per 16)
// the decode GEMV's arithmetic. The int32 results start at the bits of 1.5 * 2^23, so that
// as floats they are 1.5 * 2^23 + isum exactly (|isum| <= 32 * 128 * 127 < 2^22) and one
// subtraction converts them: no integer-to-float conversion. Each output element is accumulated
// in ascending group order by one thread: its bits depend on its row of A and column of W only.
constexpr int kI8Str = kMmaBK + 16;  // bytes per shared row: 8 ldmatrix rows on distinct banks
constexpr int kI8Groups = kMmaBK / 32;
constexpr size_t kI8Smem =
    static_cast<size_t>(2) * (kBM + kMmaBN) * (kI8Str + kI8Groups * sizeof(float4));
constexpr int kI8Magic = 0x4B400000;
constexpr float kI8MagicF = 12582912.0f;

constexpr bool scales_per_16(GgmlType t) {
  return t == GgmlType::Q2_K || t == GgmlType::Q3_K || t == GgmlType::Q6_K;
}

template <GgmlType T>
__global__ void __launch_bounds__(kMmaThreads, 2) grouped_gemm_i8_kernel(GemmArgs a) {
  pdl_enter();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (!is_float_type(T)) {
    int e, m0, m_end;
    if (!tile_rows(a, static_cast<int>(blockIdx.y), e, m0, m_end)) return;
    const int n0 = blockIdx.x * kMmaBN;
    const uint8_t* we = a.w + static_cast<size_t>(e) * a.expert_bytes;

    extern __shared__ float4 smem4[];
    float4* Am = smem4;                                                   // [2][kBM][kI8Groups]
    float4* Bm = Am + 2 * kBM * kI8Groups;                                // [2][kMmaBN][kI8Groups]
    int8_t* As = reinterpret_cast<int8_t*>(Bm + 2 * kMmaBN * kI8Groups);  // [2][kBM][kI8Str]
    int8_t* Bs = As + 2 * kBM * kI8Str;                                   // [2][kMmaBN][kI8Str]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 2) * 32, wn = (warp & 3) * 32;
    const int br = tid >> 1, bg = tid & 1;
    const int bn = n0 + br;
    const bool b_valid = bn < a.n_out;
    const uint8_t* wrow = we + static_cast<size_t>(b_valid ? bn : 0) * a.row_bytes;
    const int n_k = a.K / kMmaBK;
    const int k_groups = a.K / 32;

    // This thread's A chunk (row tid / 4, 16 bytes at (tid % 4) * 16) and, for tid < 128, its
    // metadata (row tid / 2, group tid % 2 of the step): source rows fixed for the whole K loop.
    const int ar = tid >> 2, ac = tid & 3, mr = (tid >> 1) & (kBM - 1), mg = tid & 1;
    const auto src_row = [&](int r, bool& valid) {
      const int m = m0 + r;
      valid = m < m_end;
      if (!valid) return 0;
      return a.a_list ? a.a_list[m] / a.a_div : m;
    };
    bool a_ok, m_ok;
    const int a_src = src_row(ar, a_ok);
    const int m_src = src_row(mr, m_ok);
    const int8_t* a_ptr = a.Aq + static_cast<size_t>(a_src) * a.K + ac * 16;
    const float4* m_ptr = a.Ameta + static_cast<size_t>(m_src) * k_groups + mg;
    const auto load_a = [&](int kt, int buf) {
      cp_async16(smem_addr(As + (buf * kBM + ar) * kI8Str + ac * 16), a_ptr + kt * kMmaBK, a_ok);
      if (tid < kBM * kI8Groups)
        cp_async16(smem_addr(Am + (buf * kBM + mr) * kI8Groups + mg), m_ptr + kt * kI8Groups, m_ok);
      cp_async_commit();
    };
    const auto fetch_b = [&](int kt) {
      QGroup q{};
      if (b_valid) q = load_group<T>(wrow, kt * kI8Groups + bg);
      return q;
    };
    const auto store_b = [&](const QGroup& q, int buf) {
      uint4* dst = reinterpret_cast<uint4*>(Bs + (buf * kMmaBN + br) * kI8Str + 32 * bg);
      dst[0] = make_uint4(q.q[0], q.q[1], q.q[2], q.q[3]);
      dst[1] = make_uint4(q.q[4], q.q[5], q.q[6], q.q[7]);
      Bm[(buf * kMmaBN + br) * kI8Groups + bg] = make_float4(q.sc0, q.sc1, q.m0, q.m1);
    };

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    load_a(0, 0);
    store_b(fetch_b(0), 0);
    cp_async_wait<0>();
    __syncthreads();
    const uint32_t a_lane = ((lane & 7) + ((lane >> 3) & 1) * 8) * kI8Str + (lane >> 4) * 16;
    const uint32_t b_lane = ((lane >> 4) * 8 + (lane & 7)) * kI8Str + ((lane >> 3) & 1) * 16;
    for (int kt = 0; kt < n_k; ++kt) {
      const int cur = kt & 1;
      const bool more = kt + 1 < n_k;
      QGroup qn{};
      if (more) {
        load_a(kt + 1, cur ^ 1);
        qn = fetch_b(kt + 1);
      }
      const uint32_t a_base = smem_addr(As + (cur * kBM + wm) * kI8Str) + a_lane;
      const uint32_t b_base = smem_addr(Bs + (cur * kMmaBN + wn) * kI8Str) + b_lane;
#pragma unroll
      for (int kk = 0; kk < kI8Groups; ++kk) {
        uint32_t af[2][4], bf[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
          ldsm_x4(a_base + 16 * i * kI8Str + 32 * kk, af[i][0], af[i][1], af[i][2], af[i][3]);
#pragma unroll
        for (int jp = 0; jp < 2; ++jp)
          ldsm_x4(b_base + 16 * jp * kI8Str + 32 * kk, bf[2 * jp][0], bf[2 * jp][1],
                  bf[2 * jp + 1][0], bf[2 * jp + 1][1]);
        // The rows' (d, d * sum lo, d * sum hi) of this group: rows wm + 16 i + g + 8 hr.
        float4 am[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr)
            am[i][hr] = Am[(cur * kBM + wm + 16 * i + g + 8 * hr) * kI8Groups + kk];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float4 bm[2];  // columns wn + 8 j + 2 tq + c: (sc0, sc1, m0, m1)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            bm[c] = Bm[(cur * kMmaBN + wn + 8 * j + 2 * tq + c) * kI8Groups + kk];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if constexpr (scales_per_16(T)) {
              int lo[4] = {kI8Magic, kI8Magic, kI8Magic, kI8Magic};
              int hi[4] = {kI8Magic, kI8Magic, kI8Magic, kI8Magic};
              mma_s8_k16(lo, af[i][0], af[i][1], bf[j][0]);
              mma_s8_k16(hi, af[i][2], af[i][3], bf[j][1]);
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                const float4& x = am[i][r >> 1];
                const float4& w = bm[r & 1];
                const float fl = __int_as_float(lo[r]) - kI8MagicF;
                const float fh = __int_as_float(hi[r]) - kI8MagicF;
                float v = acc[i][j][r];
                v = __fmaf_rn(w.z, x.y, v);
                v = __fmaf_rn(w.w, x.z, v);
                v = __fmaf_rn(x.x, __fmaf_rn(w.x, fl, w.y * fh), v);
                acc[i][j][r] = v;
              }
            } else {
              int c4[4] = {kI8Magic, kI8Magic, kI8Magic, kI8Magic};
              mma_s8_k32(c4, af[i], bf[j][0], bf[j][1]);
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                const float4& x = am[i][r >> 1];
                const float4& w = bm[r & 1];
                const float f = __int_as_float(c4[r]) - kI8MagicF;
                float v = acc[i][j][r];
                v = __fmaf_rn(w.z, x.y + x.z, v);
                v = __fmaf_rn(x.x, w.x * f, v);
                acc[i][j][r] = v;
              }
            }
          }
        }
      }
      if (more) store_b(qn, cur ^ 1);
      cp_async_wait<0>();
      __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = m0 + wm + 16 * i + g + 8 * hr;
        if (m >= m_end) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int n = n0 + wn + 8 * j + 2 * tq;
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (n + c < a.n_out)
              store_out(a, static_cast<size_t>(m) * a.n_out + n + c, acc[i][j][2 * hr + c]);
        }
      }
  }
#endif
}

// The grouped f16 GEMM on Hopper's wgmma (BERTH_MOE_WGMMA=1; an experiment against
// grouped_gemm_mma_kernel, with its tiles, decoding and double buffering). The two warpgroups of
// a block each compute 64 pair rows x 64 weight rows with wgmma.mma_async m64n64k16 (f16 in,
// f32 accumulate) from shared memory descriptors. Both operands are K-major without swizzle: a
// core matrix is 8 rows of 8 halves (128 contiguous bytes); A's core matrix (row block r8, k
// chunk kc) sits at kc * 1024 + r8 * 128, B's at kc * 2048 + r8 * 128 (PTX ISA, "Shared Memory
// Matrix Layout": leading byte offset = the K-direction stride, stride byte offset = the
// M/N-direction stride). Compiled only into the sm_90a code of this file (wgmma.cuh).
constexpr size_t kWgStage = static_cast<size_t>(kBM + kMmaBN) * kMmaBK * 2;
constexpr size_t kWgSmem = 2 * kWgStage;

template <GgmlType T>
__global__ void __launch_bounds__(kMmaThreads) grouped_gemm_wgmma_kernel(GemmArgs a) {
  pdl_enter();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  int e, m0, m_end;
  if (!tile_rows(a, static_cast<int>(blockIdx.y), e, m0, m_end)) return;
  const int n0 = blockIdx.x * kMmaBN;
  const uint8_t* we = a.w + static_cast<size_t>(e) * a.expert_bytes;

  extern __shared__ __align__(128) float4 smem4[];
  uint8_t* sm = reinterpret_cast<uint8_t*>(smem4);
  // Stage buf: A [8 k chunks][kBM rows][8 halves], then B [8 k chunks][kMmaBN rows][8 halves].
  const auto a_at = [&](int buf) { return sm + buf * kWgStage; };
  const auto b_at = [&](int buf) { return sm + buf * kWgStage + kBM * kMmaBK * 2; };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int br = tid >> 1, bg = tid & 1;
  const int bn = n0 + br;
  const bool b_valid = bn < a.n_out;
  const uint8_t* wrow = we + static_cast<size_t>(b_valid ? bn : 0) * a.row_bytes;
  const int n_k = a.K / kMmaBK;

  const auto load_a = [&](int kt, int buf) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // Lane pairs read 32 contiguous bytes of a row (a whole sector); a warp's writes fill
      // four whole 128-byte wavefronts.
      const int c = tid + i * kMmaThreads, r = (c >> 1) & (kBM - 1), kc = 2 * (c >> 7) + (c & 1);
      const int m = m0 + r;
      const bool valid = m < m_end;
      const __half* src = a.A + static_cast<size_t>(valid ? m : m0) * a.K + kt * kMmaBK + kc * 8;
      cp_async16(smem_addr(a_at(buf) + kc * (kBM * 16) + r * 16), src, valid);
    }
    cp_async_commit();
  };
  const auto store_b = [&](const QGroup& q, int kt, int buf) {
    uint32_t h[16];
    if (!b_valid) {
#pragma unroll
      for (int i = 0; i < 16; ++i) h[i] = 0u;
    } else if constexpr (is_float_type(T)) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int k = kt * kMmaBK + 32 * bg + 2 * i;
        h[i] = pack_half2(float_elem<T>(wrow, k), float_elem<T>(wrow, k + 1));
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        h[i] = pack_half2(group_value(q, 2 * i), group_value(q, 2 * i + 1));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint4*>(b_at(buf) + (4 * bg + i) * (kMmaBN * 16) + br * 16) =
          make_uint4(h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]);
  };
  const auto fetch_b = [&](int kt) {
    QGroup q{};
    if constexpr (!is_float_type(T)) {
      if (b_valid) q = load_group<T>(wrow, kt * 2 + bg);
    }
    return q;
  };

  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;

  load_a(0, 0);
  store_b(fetch_b(0), 0, 0);
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  for (int kt = 0; kt < n_k; ++kt) {
    const int cur = kt & 1;
    const bool more = kt + 1 < n_k;
    QGroup qn{};
    if (more) {
      load_a(kt + 1, cur ^ 1);
      qn = fetch_b(kt + 1);
    }
    const uint32_t a_base = smem_addr(a_at(cur));
    const uint32_t b_base = smem_addr(b_at(cur)) + wg * (64 / 8) * 128;
    wg_pin<32>(d);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kMmaBK / 16; ++kk)
      wg_ss_m64n64k16(d, wg_desc(a_base + 2 * kk * (kBM * 16), kBM * 16, 128),
                      wg_desc(b_base + 2 * kk * (kMmaBN * 16), kMmaBN * 16, 128));
    wg_commit();
    wg_pin<32>(d);
    if (more) store_b(qn, kt + 1, cur ^ 1);
    wg_wait0();
    wg_pin<32>(d);
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  }

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = m0 + wq * 16 + g + 8 * hr;
    if (m >= m_end) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int n = n0 + wg * 64 + 8 * j + 2 * tq;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (n + c < a.n_out)
          store_out(a, static_cast<size_t>(m) * a.n_out + n + c, d[4 * j + 2 * hr + c]);
    }
  }
#endif
}

// g = silu(g) * u over the rows of valid pairs (float down weights in decode).
__global__ void swiglu_rows_kernel(float* __restrict__ g, const float* __restrict__ u, int64_t n,
                                   const float* __restrict__ route, int k, PairSel sel) {
  pdl_enter();
  const int64_t p = blockIdx.x;
  if (slot_expert(route, p / k, k, static_cast<int>(p % k), sel) < 0) return;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
    const int64_t i = p * n + c;
    g[i] = silu_f(g[i]) * u[i];
  }
}

// Expert slots (MoeSlots::by_table): the route with each expert id replaced by its slot,
// table[e], or -1 (skipped as invalid) when e has none; weights copied. route, out [n / 2k, 2k].
__global__ void moe_slot_route_kernel(const float* __restrict__ route, int64_t n, int k,
                                      const int32_t* __restrict__ table, int n_expert, int n_slots,
                                      float* __restrict__ out) {
  pdl_enter();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = route[i];
  if (static_cast<int>(i % (2 * k)) < k) {
    float r = -1.0f;
    if (v >= 0.0f && v < static_cast<float>(n_expert)) {
      const int32_t s = table[static_cast<int>(v)];
      if (s >= 0 && s < n_slots) r = static_cast<float>(s);
    }
    v = r;
  }
  out[i] = v;
}

// out[t] = sum over valid slots j, in slot order, of weight[t, j] * y[row of (t, j)].
__global__ void moe_combine_kernel(const float* __restrict__ route, int k, PairSel sel,
                                   const int32_t* __restrict__ pos, const float* __restrict__ y,
                                   int64_t n_embd, float* __restrict__ out) {
  pdl_enter();
  const int64_t t = blockIdx.x;
  for (int64_t c = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < n_embd;
       c += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      if (slot_expert(route, t, k, j, sel) < 0) continue;
      const int64_t p = t * k + j;
      const int64_t row = pos ? pos[p] : p;
      acc = __fmaf_rn(route[t * 2 * k + k + j], y[row * n_embd + c], acc);
    }
    out[t * n_embd + c] = acc;
  }
}

// Staging of host-held experts (MoeSlots::stage): for each slot s in [sel.sb, sel.se) of token 0
// whose expert e is valid and not masked out, matrix z (gate, up, down) of expert e is copied
// from src[z] + e * bytes[z] to dst[z] + (s - sb) * bytes[z]. grid (chunks, slots, 3): block x
// copies kStageChunk bytes; each thread issues kStageLoads 16-byte loads before its stores, so
// that many PCIe reads are in flight. `vec`: every source, destination and size is 16-byte
// aligned; otherwise bytes are copied one by one.
constexpr int kStageThreads = 256, kStageLoads = 8;
constexpr size_t kStageChunk = size_t{kStageThreads} * kStageLoads * 16;

struct StageArgs {
  const uint8_t* src[3];
  uint8_t* dst[3];
  size_t bytes[3];
  bool vec;
};

__global__ void __launch_bounds__(kStageThreads)
    moe_stage_kernel(const float* __restrict__ route, int k, PairSel sel, StageArgs a) {
  pdl_enter();
  const int s = sel.sb + static_cast<int>(blockIdx.y);
  const int e = slot_expert(route, 0, k, s, sel);
  if (e < 0) return;
  const int z = static_cast<int>(blockIdx.z);
  const size_t bytes = a.bytes[z];
  const size_t c0 = static_cast<size_t>(blockIdx.x) * kStageChunk;
  if (c0 >= bytes) return;
  const size_t n = bytes - c0 < kStageChunk ? bytes - c0 : kStageChunk;
  const uint8_t* src = a.src[z] + static_cast<size_t>(e) * bytes + c0;
  uint8_t* dst = a.dst[z] + static_cast<size_t>(blockIdx.y) * bytes + c0;
  if (a.vec) {
    const auto* s4 = reinterpret_cast<const uint4*>(src);
    auto* d4 = reinterpret_cast<uint4*>(dst);
    const size_t n4 = n / 16;
    uint4 v[kStageLoads];
#pragma unroll
    for (int i = 0; i < kStageLoads; ++i) {
      const size_t q = threadIdx.x + static_cast<size_t>(i) * kStageThreads;
      if (q < n4) v[i] = s4[q];
    }
#pragma unroll
    for (int i = 0; i < kStageLoads; ++i) {
      const size_t q = threadIdx.x + static_cast<size_t>(i) * kStageThreads;
      if (q < n4) d4[q] = v[i];
    }
  } else {
    for (size_t i = threadIdx.x; i < n; i += kStageThreads) dst[i] = src[i];
  }
}

// moe_combine_kernel's grid: a token per x, 256-column chunks of n_embd over y (a decode step's
// single token used to get one block for all n_embd columns).
dim3 combine_grid(int64_t n_tok, int64_t n_embd) {
  return dim3(static_cast<unsigned>(n_tok),
              static_cast<unsigned>(std::min<int64_t>((n_embd + 255) / 256, 65535)));
}

template <GgmlType T>
void launch_grouped_gemm(const GemmArgs& a, dim3 grid, cudaStream_t s) {
  launch("grouped_gemm_kernel", grouped_gemm_kernel<T>, grid, kGemmThreads, 0, s, a);
}

// grid.x counts kMmaBN-column blocks here.
template <GgmlType T>
void launch_grouped_gemm_mma(const GemmArgs& a, dim3 grid, cudaStream_t s) {
  allow_dynamic_smem(grouped_gemm_mma_kernel<T>, kMmaSmem);
  launch("grouped_gemm_mma_kernel", grouped_gemm_mma_kernel<T>, grid, kMmaThreads, kMmaSmem, s, a);
}

// grid.x counts kMmaBN-column blocks here.
template <GgmlType T>
void launch_grouped_gemm_wgmma(const GemmArgs& a, dim3 grid, cudaStream_t s) {
  allow_dynamic_smem(grouped_gemm_wgmma_kernel<T>, kWgSmem);
  launch("grouped_gemm_wgmma_kernel", grouped_gemm_wgmma_kernel<T>, grid, kMmaThreads, kWgSmem, s,
         a);
}

// This file's sm_90a probe (wgmma.cuh).
bool wgmma_code_loaded() { return sm90a_code_loaded<1>(); }

// grid.x counts kMmaBN-column blocks here; quantized types only (moe_experts checks).
template <GgmlType T>
void launch_grouped_gemm_i8(const GemmArgs& a, dim3 grid, cudaStream_t s) {
  if constexpr (is_float_type(T)) {
    throw Error(ErrorCategory::internal, "grouped_gemm_i8_kernel: float weights");
  } else {
    launch("grouped_gemm_i8_kernel", grouped_gemm_i8_kernel<T>, grid, kMmaThreads, kI8Smem, s, a);
  }
}

}  // namespace

namespace detail {
bool& moe_gemv_fused() {
  static bool v = env_says_on("BERTH_MOE_FUSED");
  return v;
}

bool& moe_gemv_group() {
  static bool v = env_says_on("BERTH_MOE_GROUP");
  return v;
}

bool& moe_gemm_mma() {
  static bool v = !env_says_off("BERTH_MOE_MMA");
  return v;
}

bool& moe_gemm_wgmma() {
  static bool v = env_says_on("BERTH_MOE_WGMMA");
  return v;
}

bool moe_wgmma_runs() { return mma_kernels_available() && wgmma_code_loaded(); }

bool& moe_gemm_int8() {
  static bool v = env_says_on("BERTH_MOE_INT8");
  return v;
}

bool dense_gemm_mma_applies(int64_t n_in, int64_t n_rows, int64_t n_out) {
  return moe_gemm_mma() && n_in % kMmaBK == 0 && n_in <= INT32_MAX && n_out <= INT32_MAX &&
         n_rows > 0 && (n_rows + kBM - 1) / kBM <= 65535 && mma_kernels_available();
}

void dense_gemm_mma(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const __half* xh,
                    int64_t n_rows, float* out, cudaStream_t stream) {
  if ((reinterpret_cast<uintptr_t>(xh) & 15) != 0 || !dense_gemm_mma_applies(n_in, n_rows, n_out))
    throw Error(ErrorCategory::internal, "dense_gemm_mma: called outside its conditions");
  GemmArgs a{};
  a.w = static_cast<const uint8_t*>(w);
  a.row_bytes = row_bytes(type, n_in);
  a.expert_bytes = 0;
  a.n_out = static_cast<int>(n_out);
  a.K = static_cast<int>(n_in);
  a.A = xh;
  a.dense_rows = static_cast<int>(n_rows);
  a.mode = 0;
  a.C = out;
  const dim3 grid(static_cast<unsigned>((n_out + kMmaBN - 1) / kMmaBN),
                  static_cast<unsigned>((n_rows + kBM - 1) / kBM));
  BERTH_DISPATCH(type, launch_grouped_gemm_mma, a, grid, stream)
}
}  // namespace detail

namespace {

// Bytes of one expert's gate (z 0), up (1) or down (2) matrix.
size_t matrix_bytes(const MoeWeights& w, int z) {
  if (z == 2) return static_cast<size_t>(w.n_embd) * row_bytes(w.down_type, w.n_ff);
  return static_cast<size_t>(w.n_ff) * row_bytes(z == 0 ? w.gate_type : w.up_type, w.n_embd);
}

// The end of the slot range (MoeSlots::end, -1: n_expert_used).
int slot_end(const MoeWeights& w, const MoeSlots& slots) {
  return slots.end < 0 ? w.n_expert_used : slots.end;
}

// Whether moe_experts runs its prompt rows on the int8 grouped GEMM: moe_gemm_int8() and
// moe_gemm_mma() on, all three matrices quantized, n_embd and n_ff multiples of 64, and the
// mma.sync kernels available.
bool prefill_int8(const MoeWeights& w) {
  return detail::moe_gemm_int8() && detail::moe_gemm_mma() && is_quantized(w.gate_type) &&
         is_quantized(w.up_type) && is_quantized(w.down_type) && w.n_embd % kMmaBK == 0 &&
         w.n_ff % kMmaBK == 0 && mma_kernels_available();
}

// Whether the decode path runs on the fused GEMVs (moe_gemv_gate_up, moe_gemv_down: two launches
// for gate, up, SwiGLU's quantization, down and the combine): all three matrices quantized, gate
// and up of one type, n_ff a multiple of 32, and moe_gemv_fused() on.
bool decode_fused(const MoeWeights& w) {
  return detail::moe_gemv_fused() && is_quantized(w.gate_type) && w.up_type == w.gate_type &&
         is_quantized(w.down_type) && w.n_ff % 32 == 0;
}

// Workspace layout of one call (both paths); `end` is moe_workspace_bytes. With staging, the
// staged gate, up and down matrices come last, in slot order.
struct MoeLayout {
  bool decode;
  bool stage = false;                          // decode, one token, staged
  size_t hq = 0, g = 0, u = 0, aq = 0, y = 0;  // decode
  bool fused = false;  // decode on moe_gemv_gate_up / moe_gemv_down, whose counts are at cnt
  size_t cnt = 0;
  // Decode of several tokens, five launches: the routed GEMVs grouped by expert (moe_gather's
  // tiles of kMoeGroupTok pairs at grp; eoff, toff, list, pos as prefill has them).
  bool grouped = false;
  size_t grp = 0;
  size_t st[3] = {0, 0, 0};                                      // staged gate, up, down
  size_t eoff = 0, toff = 0, list = 0, pos = 0, a = 0, act = 0;  // prefill (plus g, y)
  bool int8 = false;   // prefill on the int8 GEMM: hq, g, aq, y instead of a, g, act, y
  bool remap = false;  // by_table: the slot route
  size_t rt = 0;
  size_t end = 0;

  MoeLayout(const MoeWeights& w, int64_t n_tok, const MoeSlots& slots, MoePath path) {
    const int64_t P = n_tok * w.n_expert_used;
    decode = path == MoePath::gemv || (path == MoePath::by_count && n_tok <= moe_gemv_max_tok());
    stage = decode && slots.stage && n_tok == 1;
    auto take = [&](size_t bytes) {
      const size_t at = end;
      end += align_up(bytes);
      return at;
    };
    if (slots.by_table) {
      remap = true;
      rt = take(static_cast<size_t>(2 * P) * 4);
    }
    if (decode) {
      if (is_quantized(w.gate_type) || is_quantized(w.up_type))
        hq = take(qact_bytes(n_tok, w.n_embd));
      g = take(static_cast<size_t>(P * w.n_ff) * 4);
      u = take(static_cast<size_t>(P * w.n_ff) * 4);
      if (is_quantized(w.down_type)) aq = take(qact_bytes(P, w.n_ff));
      y = take(static_cast<size_t>(P * w.n_embd) * 4);
      fused = decode_fused(w);
      if (fused)
        cnt =
            take(static_cast<size_t>(moe_gemv_counts(w.down_type, w.n_ff, w.n_embd, n_tok, P)) * 4);
      grouped = !fused && !stage && n_tok >= 2 && detail::moe_gemv_group() &&
                (is_quantized(w.gate_type) || is_quantized(w.up_type) || is_quantized(w.down_type));
      if (grouped) {
        eoff = take(static_cast<size_t>(w.n_expert + 1) * 4);
        toff = take(static_cast<size_t>(w.n_expert + 1) * 4);
        list = take(static_cast<size_t>(P) * 4);
        pos = take(static_cast<size_t>(P) * 4);
        grp = take(static_cast<size_t>(P) * sizeof(int4));
      }
      if (stage) {
        const int64_t n_sel = slot_end(w, slots) - slots.begin;
        st[0] = take(static_cast<size_t>(n_sel) * matrix_bytes(w, 0));
        st[1] = take(static_cast<size_t>(n_sel) * matrix_bytes(w, 1));
        st[2] = take(static_cast<size_t>(n_sel) * matrix_bytes(w, 2));
      }
    } else {
      eoff = take(static_cast<size_t>(w.n_expert + 1) * 4);
      toff = take(static_cast<size_t>(w.n_expert + 1) * 4);
      list = take(static_cast<size_t>(P) * 4);
      pos = take(static_cast<size_t>(P) * 4);
      int8 = prefill_int8(w);
      if (int8) {
        hq = take(qact_bytes(n_tok, w.n_embd));
        g = take(static_cast<size_t>(P * w.n_ff) * 4);
        aq = take(qact_bytes(P, w.n_ff));
      } else {
        a = take(static_cast<size_t>(P * w.n_embd) * 2);
        g = take(static_cast<size_t>(P * w.n_ff) * 4);
        act = take(static_cast<size_t>(P * w.n_ff) * 2);
      }
      y = take(static_cast<size_t>(P * w.n_embd) * 4);
    }
  }
};

void check_moe(const MoeWeights& w, const MoeSlots& slots) {
  if (slots.begin < 0 || slots.begin >= w.n_expert_used || slots.end < -1 ||
      (slots.end >= 0 && (slots.end <= slots.begin || slots.end > w.n_expert_used)))
    throw Error(ErrorCategory::invalid_argument,
                "moe_experts: slots [" + std::to_string(slots.begin) + ", " +
                    std::to_string(slots.end) + ") are not a non-empty range of the " +
                    std::to_string(w.n_expert_used) + " used");
  if (w.n_expert < 1 || w.n_expert_used < 1 || w.n_expert_used > w.n_expert || w.n_embd < 1 ||
      w.n_ff < 1)
    throw Error(ErrorCategory::invalid_argument,
                "moe_experts: bad shape (n_embd " + std::to_string(w.n_embd) + ", n_ff " +
                    std::to_string(w.n_ff) + ", n_expert " + std::to_string(w.n_expert) +
                    ", n_expert_used " + std::to_string(w.n_expert_used) + ")");
  if (slots.by_table && (slots.stage || slots.n_slots < 1 || slots.n_slots > w.n_expert))
    throw Error(ErrorCategory::invalid_argument,
                "moe_experts: " + std::to_string(slots.n_slots) + " expert slots for " +
                    std::to_string(w.n_expert) + " experts" +
                    (slots.stage ? " (and staged weights, which slots never are)" : ""));
  check_type(w.gate_type, w.n_embd, "moe_experts (gate)");
  check_type(w.up_type, w.n_embd, "moe_experts (up)");
  check_type(w.down_type, w.n_ff, "moe_experts (down)");
}

}  // namespace

size_t moe_workspace_bytes(const MoeWeights& w, int64_t n_tok, const MoeSlots& slots,
                           MoePath path) {
  check_moe(w, slots);
  if (n_tok <= 0) return 0;
  return MoeLayout(w, n_tok, slots, path).end;
}

void moe_experts(const MoeWeights& w, const float* h, const float* route, int64_t n_tok,
                 const uint8_t* expert_mask, float* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, const MoeSlots& slots, MoePath path) {
  check_moe(w, slots);
  if (n_tok <= 0) return;
  const MoeLayout L(w, n_tok, slots, path);
  if (workspace_bytes < L.end || workspace == nullptr)
    throw Error(ErrorCategory::invalid_argument, "moe_experts: workspace of " +
                                                     std::to_string(workspace_bytes) + " bytes, " +
                                                     std::to_string(L.end) + " needed");
  auto* ws = static_cast<uint8_t*>(workspace);
  // Expert slots: the slots stand for the experts (ids remapped through the table, the weights
  // are the slot arrays, no mask); everything below then runs as over n_slots experts.
  MoeWeights wk = w;
  const float* rt = route;
  const uint8_t* mask = expert_mask;
  if (L.remap) {
    if (slots.table == nullptr)
      throw Error(ErrorCategory::invalid_argument, "moe_experts: expert slots without a table");
    auto* remapped = reinterpret_cast<float*>(ws + L.rt);
    const int64_t n = n_tok * 2 * w.n_expert_used;
    launch("moe_slot_route_kernel", moe_slot_route_kernel, static_cast<unsigned>((n + 255) / 256),
           256, 0, stream, route, n, w.n_expert_used, slots.table, w.n_expert, slots.n_slots,
           remapped);
    wk.n_expert = slots.n_slots;
    rt = remapped;
    mask = nullptr;
  }
  const PairSel sel{mask, wk.n_expert, slots.begin, slot_end(w, slots)};
  const int k = wk.n_expert_used;
  const int64_t P = n_tok * k;
  const size_t gate_bytes = static_cast<size_t>(w.n_ff) * row_bytes(w.gate_type, w.n_embd);
  const size_t up_bytes = static_cast<size_t>(w.n_ff) * row_bytes(w.up_type, w.n_embd);
  const size_t down_bytes = static_cast<size_t>(w.n_embd) * row_bytes(w.down_type, w.n_ff);
  auto* G = reinterpret_cast<float*>(ws + L.g);
  auto* Y = reinterpret_cast<float*>(ws + L.y);

  if (L.decode) {
    if (P > 65535)
      throw Error(ErrorCategory::invalid_argument, "moe_experts: too many (token, slot) pairs");
    QAct hq{}, aq{};
    auto* cnt = reinterpret_cast<unsigned*>(ws + L.cnt);
    if (is_quantized(w.gate_type) || is_quantized(w.up_type)) {
      hq = qact_at(ws + L.hq, n_tok, w.n_embd);
      // (The fused GEMVs' counts are zeroed by the same launch.)
      quantize_act(h, nullptr, n_tok, w.n_embd, hq, stream, L.fused ? cnt : nullptr,
                   L.fused ? moe_gemv_counts(w.down_type, w.n_ff, w.n_embd, n_tok, P) : 0);
    }
    auto* U = reinterpret_cast<float*>(ws + L.u);
    const void* wg = w.gate;
    const void* wu = w.up;
    const void* wd = w.down;
    if (L.stage) {
      StageArgs sa{};
      sa.vec = true;
      const void* src[3] = {w.gate, w.up, w.down};
      size_t most = 0;
      for (int z = 0; z < 3; ++z) {
        sa.src[z] = static_cast<const uint8_t*>(src[z]);
        sa.dst[z] = ws + L.st[z];
        sa.bytes[z] = matrix_bytes(w, z);
        most = std::max(most, sa.bytes[z]);
        sa.vec = sa.vec && sa.bytes[z] % 16 == 0 &&
                 (reinterpret_cast<uintptr_t>(sa.src[z]) & 15) == 0 &&
                 (reinterpret_cast<uintptr_t>(sa.dst[z]) & 15) == 0;
      }
      const dim3 grid(static_cast<unsigned>((most + kStageChunk - 1) / kStageChunk),
                      static_cast<unsigned>(sel.se - sel.sb), 3);
      launch("moe_stage_kernel", moe_stage_kernel, grid, kStageThreads, 0, stream, rt, k, sel, sa);
      wg = sa.dst[0], wu = sa.dst[1], wd = sa.dst[2];
    }
    GemvRoute r;
    r.route = rt;
    r.k = k;
    r.act_div = k;
    r.mask = mask;
    r.n_expert = wk.n_expert;
    r.pairs = P;
    r.slot_begin = sel.sb;
    r.slot_end = sel.se;
    r.by_slot = L.stage;
    r.expert_bytes = gate_bytes;
    if (L.fused) {
      aq = qact_at(ws + L.aq, P, w.n_ff);
      moe_gemv_gate_up(w.gate_type, wg, wu, up_bytes, w.n_embd, w.n_ff, hq, G, U, aq, cnt, r,
                       stream);
      r.act_div = 1;
      r.expert_bytes = down_bytes;
      moe_gemv_down(w.down_type, wd, w.n_ff, w.n_embd, aq, Y, out, cnt + P, r, stream);
      return;
    }
    const int4* groups = nullptr;
    const int32_t* group_list = nullptr;
    if (L.grouped) {
      auto* list = reinterpret_cast<int32_t*>(ws + L.list);
      auto* grp = reinterpret_cast<int4*>(ws + L.grp);
      launch("moe_gather_kernel", moe_gather_kernel, 1, 32, static_cast<size_t>(wk.n_expert) * 4,
             stream, rt, n_tok, k, sel, reinterpret_cast<int32_t*>(ws + L.eoff),
             reinterpret_cast<int32_t*>(ws + L.toff), list, reinterpret_cast<int32_t*>(ws + L.pos),
             kMoeGroupTok, grp);
      groups = grp;
      group_list = list;
    }
    // Each GEMV on quantized weights by group, on float weights by pair.
    const auto by_group = [&](GgmlType t) {
      const bool q = is_quantized(t);
      r.groups = q ? groups : nullptr;
      r.group_list = q ? group_list : nullptr;
    };
    by_group(w.gate_type);
    gemv(w.gate_type, wg, w.n_embd, w.n_ff, h, hq, 1, G, w.n_ff, r, stream);
    r.expert_bytes = up_bytes;
    by_group(w.up_type);
    gemv(w.up_type, wu, w.n_embd, w.n_ff, h, hq, 1, U, w.n_ff, r, stream);
    if (is_quantized(w.down_type)) {
      aq = qact_at(ws + L.aq, P, w.n_ff);
      quantize_act(G, U, P, w.n_ff, aq, stream);
    } else {
      launch("swiglu_rows_kernel", swiglu_rows_kernel, static_cast<unsigned>(P), 256, 0, stream, G,
             U, w.n_ff, rt, k, sel);
    }
    r.act_div = 1;
    r.expert_bytes = down_bytes;
    by_group(w.down_type);
    gemv(w.down_type, wd, w.n_ff, w.n_embd, G, aq, 1, Y, w.n_embd, r, stream);
    launch("moe_combine_kernel", moe_combine_kernel, combine_grid(n_tok, w.n_embd), 256, 0, stream,
           rt, k, sel, nullptr, Y, w.n_embd, out);
    return;
  }

  if (w.n_embd % kBK != 0 || w.n_ff % kBK != 0)
    throw Error(ErrorCategory::invalid_argument,
                "moe_experts: n_embd and n_ff must be multiples of 32 for batched tokens");
  auto* eoff = reinterpret_cast<int32_t*>(ws + L.eoff);
  auto* toff = reinterpret_cast<int32_t*>(ws + L.toff);
  auto* list = reinterpret_cast<int32_t*>(ws + L.list);
  auto* pos = reinterpret_cast<int32_t*>(ws + L.pos);
  launch("moe_gather_kernel", moe_gather_kernel, 1, 32, static_cast<size_t>(wk.n_expert) * 4,
         stream, rt, n_tok, k, sel, eoff, toff, list, pos, kBM, static_cast<int4*>(nullptr));
  const unsigned max_tiles = static_cast<unsigned>((P + kBM - 1) / kBM + wk.n_expert);
  GemmArgs a{};
  a.expert_off = eoff;
  a.tile_off = toff;
  a.n_expert = wk.n_expert;
  if (L.int8) {
    // h quantized once per token (the gate and up GEMMs read row list[m] / k), gate, up with
    // G = silu(G) * up in its epilogue, G quantized per pair row, down.
    const QAct hq = qact_at(ws + L.hq, n_tok, w.n_embd);
    quantize_act(h, nullptr, n_tok, w.n_embd, hq, stream);
    const dim3 grid_ff(static_cast<unsigned>((w.n_ff + kMmaBN - 1) / kMmaBN), max_tiles);
    const dim3 grid_embd(static_cast<unsigned>((w.n_embd + kMmaBN - 1) / kMmaBN), max_tiles);
    a.Aq = hq.q;
    a.Ameta = hq.meta;
    a.a_list = list;
    a.a_div = k;
    a.K = static_cast<int>(w.n_embd);
    a.n_out = static_cast<int>(w.n_ff);
    a.w = static_cast<const uint8_t*>(w.gate);
    a.row_bytes = row_bytes(w.gate_type, w.n_embd);
    a.expert_bytes = gate_bytes;
    a.mode = 0;
    a.C = G;
    BERTH_DISPATCH(w.gate_type, launch_grouped_gemm_i8, a, grid_ff, stream)
    a.w = static_cast<const uint8_t*>(w.up);
    a.row_bytes = row_bytes(w.up_type, w.n_embd);
    a.expert_bytes = up_bytes;
    a.mode = 2;
    a.G = G;
    BERTH_DISPATCH(w.up_type, launch_grouped_gemm_i8, a, grid_ff, stream)
    const QAct aq = qact_at(ws + L.aq, P, w.n_ff);
    quantize_act(G, nullptr, P, w.n_ff, aq, stream);
    a.Aq = aq.q;
    a.Ameta = aq.meta;
    a.a_list = nullptr;
    a.a_div = 1;
    a.K = static_cast<int>(w.n_ff);
    a.n_out = static_cast<int>(w.n_embd);
    a.w = static_cast<const uint8_t*>(w.down);
    a.row_bytes = row_bytes(w.down_type, w.n_ff);
    a.expert_bytes = down_bytes;
    a.mode = 0;
    a.C = Y;
    BERTH_DISPATCH(w.down_type, launch_grouped_gemm_i8, a, grid_embd, stream)
    launch("moe_combine_kernel", moe_combine_kernel, combine_grid(n_tok, w.n_embd), 256, 0, stream,
           rt, k, sel, pos, Y, w.n_embd, out);
    return;
  }
  auto* A = reinterpret_cast<__half*>(ws + L.a);
  auto* act = reinterpret_cast<__half*>(ws + L.act);
  to_half(h, P, w.n_embd, list, k, eoff + wk.n_expert, A, stream);
  // gate: G = A . gate_e^T
  a.w = static_cast<const uint8_t*>(w.gate);
  a.row_bytes = row_bytes(w.gate_type, w.n_embd);
  a.expert_bytes = gate_bytes;
  a.n_out = static_cast<int>(w.n_ff);
  a.K = static_cast<int>(w.n_embd);
  a.A = A;
  a.mode = 0;
  a.C = G;
  // The mma.sync kernel where it applies (K steps of 64 over both matrices' inputs, 16-byte
  // aligned activation rows), the WMMA kernel otherwise.
  const bool use_mma = detail::moe_gemm_mma() && w.n_embd % kMmaBK == 0 && w.n_ff % kMmaBK == 0 &&
                       reinterpret_cast<uintptr_t>(A) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(act) % 16 == 0 && mma_kernels_available();
  const bool use_wgmma = use_mma && detail::moe_gemm_wgmma() && wgmma_code_loaded();
  const int bn = use_mma ? kMmaBN : kBN;
  const auto run_gemm = [&](GgmlType t, const dim3& grid) {
    if (use_wgmma) {
      BERTH_DISPATCH(t, launch_grouped_gemm_wgmma, a, grid, stream)
    } else if (use_mma) {
      BERTH_DISPATCH(t, launch_grouped_gemm_mma, a, grid, stream)
    } else {
      BERTH_DISPATCH(t, launch_grouped_gemm, a, grid, stream)
    }
  };
  dim3 grid_ff(static_cast<unsigned>((w.n_ff + bn - 1) / bn), max_tiles);
  run_gemm(w.gate_type, grid_ff);
  // up, with act = f16(silu(G) * up) in the epilogue
  a.w = static_cast<const uint8_t*>(w.up);
  a.row_bytes = row_bytes(w.up_type, w.n_embd);
  a.expert_bytes = up_bytes;
  a.mode = 1;
  a.G = G;
  a.act = act;
  run_gemm(w.up_type, grid_ff);
  // down: Y = act . down_e^T
  a.w = static_cast<const uint8_t*>(w.down);
  a.row_bytes = row_bytes(w.down_type, w.n_ff);
  a.expert_bytes = down_bytes;
  a.n_out = static_cast<int>(w.n_embd);
  a.K = static_cast<int>(w.n_ff);
  a.A = act;
  a.mode = 0;
  a.C = Y;
  dim3 grid_embd(static_cast<unsigned>((w.n_embd + bn - 1) / bn), max_tiles);
  run_gemm(w.down_type, grid_embd);
  launch("moe_combine_kernel", moe_combine_kernel, combine_grid(n_tok, w.n_embd), 256, 0, stream,
         rt, k, sel, pos, Y, w.n_embd, out);
}

}  // namespace berth::gpu
