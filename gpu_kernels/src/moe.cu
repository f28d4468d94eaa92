// Routed experts of a MoE layer: moe_workspace_bytes, moe_experts.
//
// Decode (n_tok <= moe_gemv_max_tok()): h is quantized once; one routed GEMV launch per matrix
// covers all n_tok * k (token, slot) pairs (grid row = pair; the expert id is read from `route`
// on the device, masked or invalid slots exit at once): gate, up, then SwiGLU fused into the
// quantization of the down input, then down; a combine kernel sums each token's slots in slot
// order.
//
// Prefill: a one-warp kernel lists the valid pairs grouped by expert (experts ascending, pairs
// in token order within each: a stable counting sort with warp match/popc, no atomics) and
// writes per-expert offsets and 64-row tile offsets; h rows are gathered to f16 in that order;
// a grouped tensor-core GEMM (f16 in / f32 accumulate, 64-row tiles, weights dequantized into
// shared memory group by group: grouped_gemm_mma_kernel on mma.sync, or grouped_gemm_kernel on
// WMMA where that does not apply) runs gate, then up with SwiGLU in its epilogue, then down. The
// mma.sync kernel also serves matmul's invariant prompt rows as one group (dense_gemm_mma). Its
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

// One warp. Outputs: expert_off / tile_off [n_expert + 1], list [valid pairs] (pair ids grouped
// by expert), pos [P] (row of each pair in the list, -1 when skipped).
__global__ void moe_gather_kernel(const float* __restrict__ route, int64_t n_tok, int k,
                                  PairSel sel, int32_t* __restrict__ expert_off,
                                  int32_t* __restrict__ tile_off, int32_t* __restrict__ list,
                                  int32_t* __restrict__ pos) {
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
  if (lane == 0) {
    int32_t off = 0, toff = 0;
    for (int e = 0; e < n_expert; ++e) {
      const int32_t c = cnt[e];
      expert_off[e] = off;
      tile_off[e] = toff;
      cnt[e] = off;  // becomes the cursor
      off += c;
      toff += (c + kBM - 1) / kBM;
    }
    expert_off[n_expert] = off;
    tile_off[n_expert] = toff;
  }
  __syncwarp();
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
  int mode;  // 0: C = result (f32); 1: act = f16(silu(G) * result)
  float* C;
  const float* G;
  __half* act;
};

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
    const size_t o = static_cast<size_t>(m) * a.n_out + n;
    const float v = Cs[r][c];
    if (a.mode == 0)
      a.C[o] = v;
    else
      a.act[o] = __float2half_rn(silu_f(a.G[o]) * v);
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
          const size_t o = static_cast<size_t>(m) * a.n_out + n + c;
          const float v = acc[i][j][2 * hr + c];
          if (a.mode == 0)
            a.C[o] = v;
          else
            a.act[o] = __float2half_rn(silu_f(a.G[o]) * v);
        }
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
      acc += route[t * 2 * k + k + j] * y[row * n_embd + c];
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

}  // namespace

namespace detail {
bool& moe_gemm_mma() {
  static bool v = !env_says_off("BERTH_MOE_MMA");
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

// Workspace layout of one call (both paths); `end` is moe_workspace_bytes. With staging, the
// staged gate, up and down matrices come last, in slot order.
struct MoeLayout {
  bool decode;
  bool stage = false;                                            // decode, one token, staged
  size_t hq = 0, g = 0, u = 0, aq = 0, y = 0;                    // decode
  size_t st[3] = {0, 0, 0};                                      // staged gate, up, down
  size_t eoff = 0, toff = 0, list = 0, pos = 0, a = 0, act = 0;  // prefill (plus g, y)
  bool remap = false;                                            // by_table: the slot route
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
      a = take(static_cast<size_t>(P * w.n_embd) * 2);
      g = take(static_cast<size_t>(P * w.n_ff) * 4);
      act = take(static_cast<size_t>(P * w.n_ff) * 2);
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
    if (is_quantized(w.gate_type) || is_quantized(w.up_type)) {
      hq = qact_at(ws + L.hq, n_tok, w.n_embd);
      quantize_act(h, nullptr, n_tok, w.n_embd, hq, stream);
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
    gemv(w.gate_type, wg, w.n_embd, w.n_ff, h, hq, 1, G, w.n_ff, r, stream);
    r.expert_bytes = up_bytes;
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
  auto* A = reinterpret_cast<__half*>(ws + L.a);
  auto* act = reinterpret_cast<__half*>(ws + L.act);
  launch("moe_gather_kernel", moe_gather_kernel, 1, 32, static_cast<size_t>(wk.n_expert) * 4,
         stream, rt, n_tok, k, sel, eoff, toff, list, pos);
  to_half(h, P, w.n_embd, list, k, eoff + wk.n_expert, A, stream);
  const unsigned max_tiles = static_cast<unsigned>((P + kBM - 1) / kBM + wk.n_expert);
  GemmArgs a{};
  a.expert_off = eoff;
  a.tile_off = toff;
  a.n_expert = wk.n_expert;
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
  const int bn = use_mma ? kMmaBN : kBN;
  const auto run_gemm = [&](GgmlType t, const dim3& grid) {
    if (use_mma) {
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
