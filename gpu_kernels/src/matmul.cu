// Matrix products with ggml-typed weights: supports, matmul, embed, and the GEMV / dequantization
// kernels moe.cu shares (matmul_internal.h).
//
// Decode (n_tok <= gemv_max_tok()): the activations are quantized on the device to int8 in
// groups of 32 (scale d, plus d * the sum of each half's quants for the weight offsets), and a
// GEMV takes integer dot products (__dp4a) against each 32-element group of weights, decoded
// as sc*q + m per half (quant_blocks.cuh). A row is split over `lpr` lanes of a warp (32, 16,
// ..., chosen so that the groups of a row fill the lanes), 4 warps per block; each lane walks
// its row's groups with stride lpr (consecutive lanes read consecutive blocks: coalesced) and
// keeps up to kGemvTok token accumulators, so each weight is read once per 8 tokens; the lanes
// of a row finish with a butterfly reduction. Q4_K, Q5_K and Q6_K take their own kernel
// (gemv_kq_block, gemv_kq() on by default): 64-element units per lane whose loaded bytes are all
// used by that lane (16-byte loads of the superblock header and quants), two rows per lane set
// in large launches, each step's loads of all its rows issued before any is decoded; one-token
// launches compiled for 7 blocks per SM (gemv_kq_minb(): at most 72 registers). Float weights: the
// same layout as the group kernel with 8 elements (one 16-byte load of f16/bf16, two of f32) per
// lane step and f32 activations; launches of few long rows (Qwen3.5's ssm_alpha / ssm_beta) spread
// a row over 128 lanes (4 warps, summed through shared memory). Lanes per row follow n_in (and, for
// float weights, the matrix's row count), never the token count, so a row's bits never depend on
// it.
//
// Rows by kind (issue 19: a row's bits never depend on the step's size or its other rows): the
// last n_decode rows (decode tokens) take the GEMV above in launches of up to kGemvTok rows, whose
// per-row arithmetic is the same for 1 or 8 rows; the other rows (prompt tokens) take the GEMM
// below whatever their number (with F32 weights, the GEMV too: f32 activations, as on the CPU).
//
// Prompt rows: x is converted to f16. With `invariant` (several sequences) they go to the grouped
// mma.sync GEMM of moe.cu with one group (dense_gemm_mma: weight groups decoded to f16 in shared
// memory; n_in a multiple of 64, compute capability 8.0+, BERTH_MOE_MMA not 0), else the weights
// are dequantized to f16 in chunks of at most kChunkBytes (F16 weights are read directly) and
// gemm_f16_kernel, a WMMA tensor-core GEMM of our own, multiplies each chunk. Both take f16
// inputs and accumulate in f32, each output element over k in ascending steps of 16 by one
// warp's mma, so its bits depend on its row of x and its column of W only, never on how many rows
// the call has. cuBLAS chooses its algorithm, tiles and split-K by shape, so its rows' bits may
// change with the row count: it multiplies the prompt rows (on the f16 chunks) only when the
// caller does not need that (matmul's `invariant` false: a session of one sequence), where it is
// faster (pp512 5036 against 2986 tok/s on the H200 against the WMMA GEMM, docs/performance.md).
#include <cooperative_groups.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "act_quant.cuh"
#include "berth/core/env.h"
#include "berth/core/error.h"
#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "handoff.cuh"
#include "launch.cuh"
#include "matmul_internal.h"
#include "quant_blocks.cuh"
#include "route.cuh"

namespace berth::gpu {
namespace detail {

// Crossover between the GEMV (token chunks of 8, each re-reading the weights) and dequantize +
// cuBLAS (writes and reads 2 bytes per weight, then runs at tensor-core speed). Measured on an
// H200 ("timing" case of tests/gpu/test_gpu_matmul.cpp), 4096 x 4096: Q4_K GEMV 0.026 ms at 8
// tokens, 0.049 at 16, cuBLAS path 0.047 flat; Q8_0 0.031 / 0.059 vs 0.045; F16 GEMV 0.042 ms
// at 8 tokens vs cuBLAS 0.022 (the float GEMV reads 4x the bytes per token and is slower per
// token, crossing near 3 tokens).
int& gemv_max_tok() {
  static int v = 8;
  return v;
}
bool& gemv_group_tokens() {
  static bool v = !env_says_off("BERTH_GEMV_GROUP_TOK");
  return v;
}
bool& gemv_tok4() {
  static bool v = env_says_on("BERTH_GEMV_TOK4");
  return v;
}
bool& gemv_kq() {
  static bool v = !env_says_off("BERTH_GEMV_KQ");
  return v;
}
// BERTH_GEMV_KQ_LANES: 0 (default), 1 or 2 (kernels.h); another value throws
// Error(invalid_argument).
int& gemv_kq_lanes() {
  static int v = static_cast<int>(env_uint("BERTH_GEMV_KQ_LANES", 2).value_or(0));
  return v;
}
// BERTH_GEMV_KQ_RPS: 0 (default: by the launch's size), 1 or 2; another value throws, as above.
int& gemv_kq_rps() {
  static int v = static_cast<int>(env_uint("BERTH_GEMV_KQ_RPS", 2).value_or(0));
  return v;
}
// BERTH_GEMV_KQ_MINB: 7 (default), 0 or 8 (kernels.h); another value throws
// Error(invalid_argument).
int& gemv_kq_minb() {
  static int v = [] {
    const int m = static_cast<int>(env_uint("BERTH_GEMV_KQ_MINB", 8).value_or(7));
    if (m != 0 && m != 7 && m != 8)
      throw Error(ErrorCategory::invalid_argument,
                  "BERTH_GEMV_KQ_MINB=" + std::to_string(m) + ": expected 0, 7 or 8");
    return m;
  }();
  return v;
}
int& gemv_max_tok_float() {
  static int v = 3;
  return v;
}
bool matmul_uses_gemv(GgmlType t, int64_t n_tok) {
  return n_tok <= (is_float_type(t) ? gemv_max_tok_float() : gemv_max_tok());
}
// MoE: the per-pair GEMV re-reads an expert for every token that picks it; the grouped GEMM
// reads it once per 64 tokens but is a plain WMMA kernel. Measured (128 experts, 8 used,
// 2048 -> 768, Q4_K/Q6_K): GEMV path 0.50 ms vs grouped 1.38 ms at 32 tokens, 0.96 vs 1.55 at
// 64, 7.3 vs 1.8 at 512.
int& moe_gemv_max_tok() {
  static int v = 64;
  return v;
}

bool is_quantized(GgmlType t) { return !is_float_type(t); }

void check_type(GgmlType t, int64_t n, const char* what) {
  if (!supports(t))
    throw Error(ErrorCategory::unsupported, std::string(what) + ": weight type " +
                                                std::string(type_name(t)) +
                                                " is not supported on the GPU");
  if (n < 0 || n % block_elems(t) != 0)
    throw Error(ErrorCategory::invalid_argument,
                std::string(what) + ": row length " + std::to_string(n) +
                    " is not a multiple of the block size of " + std::string(type_name(t)));
}

size_t qact_bytes(int64_t rows, int64_t n) {
  return align_up(static_cast<size_t>(rows * n)) + static_cast<size_t>(rows * (n / 32)) * 16;
}

QAct qact_at(void* p, int64_t rows, int64_t n) {
  auto* b = static_cast<uint8_t*>(p);
  return {reinterpret_cast<int8_t*>(b),
          reinterpret_cast<float4*>(b + align_up(static_cast<size_t>(rows * n)))};
}

namespace {

constexpr int kThreads = 128;  // 4 warps per GEMV block

// Rows one GEMV block computes: 4 warps, 32 / lpr lane sets per warp, rps rows per lane set
// (lpr 64 or 128: a row spans warps, rps 1).
__host__ __device__ constexpr int64_t rows_per_block(int lpr, int rps) {
  return lpr <= 32 ? (kThreads / 32) * (32 / lpr) * rps : kThreads / lpr;
}

__device__ __forceinline__ float silu(float z) { return z / (1.0f + __expf(-z)); }

// One warp per group of 32 values. With `up`: the values are silu(x) * up (kSwiglu: swiglu_kernel's
// arithmetic in elementwise.cu, x / (1 + expf(-x)) * up, so the blocks are those of swiglu's
// output; else the MoE GEMVs' silu with __expf).
// Threads i < n_zero also set zero[i] = 0 (the counts of moe_gemv_kernel).
template <bool kSwiglu>
__global__ void quantize_act_kernel(const float* __restrict__ x, const float* __restrict__ up,
                                    int64_t n_groups, int8_t* __restrict__ q,
                                    float4* __restrict__ meta, unsigned* __restrict__ zero,
                                    int64_t n_zero) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid < n_zero) zero[tid] = 0;
  const int64_t grp = tid >> 5;
  if (grp >= n_groups) return;  // whole warps
  const int64_t i = grp * 32 + lane;
  float v = x[i];
  if (up) v = kSwiglu ? v / (1.0f + expf(-v)) * up[i] : silu(v) * up[i];
  quantize_group(v, lane, q + grp * 32, meta + grp);
}

struct GemvArgs {
  const uint8_t* w;
  size_t row_bytes;
  int64_t n_in, n_out;
  const float* xf;
  const int8_t* xq;
  const float4* xm;
  int n_tok;
  float* out;
  int64_t out_stride;
  GemvRoute r;
  int lpr;          // lanes per row (power of two <= 32)
  int rps = 1;      // rows per lane set (gemv_kq_block: 1 or 2; 1 elsewhere)
  bool kq = false;  // Q4_K / Q5_K / Q6_K through gemv_kq_block (gemv_kq() on)
  bool vec;         // float kernel: 16-byte loads allowed
  // Quantized single-token calls only (matmul_group): up to two more matrices of the same type
  // and n_in, whose rows follow the first's in the grid (rows n_out.. are the second's, ...).
  const uint8_t* w_more[2];
  float* out_more[2];
  int64_t rows_more[2];
  int n_more;
};

// Rows past the first matrix belong to the next ones (a matmul group): moves row r of the launch
// to its matrix (weights w, output out, n_out rows); a row past them all keeps r >= n_out. A
// group's outputs are [n_tok, n_out] each: out_stride_of gives the stride of a token's row.
__device__ __forceinline__ void group_row(const GemvArgs& a, int64_t& r, const uint8_t*& w,
                                          float*& out, int64_t& n_out) {
  for (int j = 0; j < a.n_more && r >= n_out; ++j) {
    r -= n_out;
    w = a.w_more[j];
    out = a.out_more[j];
    n_out = a.rows_more[j];
  }
}
__device__ __forceinline__ int64_t out_stride_of(const GemvArgs& a, int64_t n_out) {
  return a.n_more > 0 ? n_out : a.out_stride;
}

// Expert of slot j of token t of a route, or -1 when the slot is outside [slot_begin,
// slot_end), its id is invalid or its expert is masked out.
__device__ __forceinline__ int route_expert(const GemvRoute& r, int64_t t, int64_t j) {
  if (j < r.slot_begin || j >= r.slot_end) return -1;
  const float ev = r.route[t * 2 * r.k + j];
  if (!(ev >= 0.0f && ev < static_cast<float>(r.n_expert))) return -1;
  const int e = static_cast<int>(ev);
  if (r.mask && r.mask[e] == 0) return -1;
  return e;
}

// Resolves the routed expert of this block (blockIdx.y = pair) in the matrices at base, expert
// stride expert_bytes (a.w / a.r.expert_bytes, or another matrix of the same shape and route).
// False: slot skipped.
__device__ __forceinline__ bool gemv_setup_bytes(const GemvArgs& a, const uint8_t* base,
                                                 size_t expert_bytes, const uint8_t*& w,
                                                 int64_t& act0, int64_t& out0) {
  w = base;
  act0 = 0;
  out0 = 0;
  if (a.r.route == nullptr) return true;
  const int64_t p = blockIdx.y;
  const int64_t t = p / a.r.k, j = p % a.r.k;
  const int e = route_expert(a.r, t, j);
  if (e < 0) return false;
  const int64_t m =
      a.r.by_slot ? t * (a.r.slot_end - a.r.slot_begin) + j - a.r.slot_begin : int64_t{e};
  w += static_cast<size_t>(m) * expert_bytes;
  act0 = p / a.r.act_div;
  out0 = p;
  return true;
}

// gemv_setup_bytes on a's own matrices.
__device__ __forceinline__ bool gemv_setup(const GemvArgs& a, const uint8_t*& w, int64_t& act0,
                                           int64_t& out0) {
  return gemv_setup_bytes(a, a.w, a.r.expert_bytes, w, act0, out0);
}

// The pairs of a grouped routed block (GemvRoute::groups): activation and output row of each of
// its n pairs (entries past n repeat the last pair; they are never summed or stored).
struct GroupRows {
  int64_t act[kMoeGroupTok];
  int64_t out[kMoeGroupTok];
  int n;
};

// This block's group (blockIdx.y) of a grouped routed GEMV: its expert's matrix in w (a.w,
// expert stride a.r.expert_bytes) and its pairs' rows. False: no group (uniform over the block).
__device__ __forceinline__ bool group_setup(const GemvArgs& a, const uint8_t*& w, GroupRows& g) {
  const int4 grp = a.r.groups[blockIdx.y];
  if (grp.z <= 0) return false;
  w = a.w + static_cast<size_t>(grp.x) * a.r.expert_bytes;
  g.n = grp.z;
#pragma unroll
  for (int t = 0; t < kMoeGroupTok; ++t) {
    const int64_t p = a.r.group_list[grp.y + (t < grp.z ? t : grp.z - 1)];
    g.act[t] = p / a.r.act_div;
    g.out[t] = p;
  }
  return true;
}

// Warps of a block that gemv_store's shared sums serve (router_route_kernel's 16).
constexpr int kStoreWarps = 16;

// Reduce-scatter of NT tokens' partial sums over a row's lanes, stages o = O, O / 2, .., 1 (the
// butterfly's order): while a lane holds M > 1 tokens it swaps half of them with lane ^ o (the
// upper half stays where lane & o is set) and adds the other's half to the half it keeps; once it
// holds one token, a plain butterfly step. Each sum is the butterfly's (the same pairs added at
// every stage, a + b == b + a), for NT / 2 + NT / 4 + .. shuffles instead of NT per stage. On
// return v[0 .. max(1, NT / (2O))) are the sums of tokens idx, idx + 1, ...
template <int M, int O, int NT>
__device__ __forceinline__ void reduce_scatter(float (&v)[NT], int lane, int& idx) {
  if constexpr (O >= 1) {
    if constexpr (M > 1) {
      const bool hi = (lane & O) != 0;
#pragma unroll
      for (int i = 0; i < M / 2; ++i) {
        const float send = hi ? v[i] : v[i + M / 2];
        const float keep = hi ? v[i + M / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      if (hi) idx += M / 2;
      reduce_scatter<M / 2, O / 2, NT>(v, lane, idx);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      reduce_scatter<1, O / 2, NT>(v, lane, idx);
    }
  }
}

// NT: accumulators per thread (1 for single-token calls, kGemvTok otherwise).
// Epilogue of the GEMVs: the lanes of a row sum their partial dot products, lane 0 stores them.
// Up to 32 lanes per row: a butterfly of shuffles. 64 or 128 (float weights, few rows: a row
// spans 2 or 4 warps, gemv_shape): the butterfly within each warp, then the row's first lane
// adds its warps' sums in order, (w0 + w1) or (w0 + w1) + (w2 + w3), from shared memory; every
// thread of the block must then call it.
// Token t's value of row r goes to out[(out0 + t) * stride + r]; kGroup: the tokens are the pairs
// of `g` (NT = kMoeGroupTok), output row g.out[t] instead of out0 + t.
template <int NT, bool kGroup = false>
__device__ __forceinline__ void gemv_store(const GemvArgs& a, float (&acc)[NT], bool active, int sl,
                                           int64_t out0, int64_t r, float* out, int64_t stride,
                                           const GroupRows* g = nullptr) {
  const int wl = a.lpr < 32 ? a.lpr : 32;
  if constexpr (NT > 1) {
    if (a.lpr <= 32 && a.lpr > 1) {
      // Several tokens on a row within a warp: reduce-scatter (the butterfly's sums), then the
      // lanes holding a token's sum (the first of each set of wl / NT lanes when wl > NT) store.
      const int lane = static_cast<int>(threadIdx.x & 31);
      int idx = 0;
      switch (wl) {
        case 32:
          reduce_scatter<NT, 16, NT>(acc, lane, idx);
          break;
        case 16:
          reduce_scatter<NT, 8, NT>(acc, lane, idx);
          break;
        case 8:
          reduce_scatter<NT, 4, NT>(acc, lane, idx);
          break;
        case 4:
          reduce_scatter<NT, 2, NT>(acc, lane, idx);
          break;
        default:
          reduce_scatter<NT, 1, NT>(acc, lane, idx);
          break;
      }
      const int held = NT >= wl ? NT / wl : 1;
      const int idle = wl > NT ? wl / NT - 1 : 0;  // low lane bits of a token's other holders
      if (!active || (sl & idle) != 0) return;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        if (i >= held) break;
        const int t = idx + i;
        if constexpr (kGroup) {
          if (t < g->n) {
            int64_t row = g->out[0];
#pragma unroll
            for (int j = 1; j < NT; ++j)
              if (j == t) row = g->out[j];
            out[row * stride + r] = acc[i];
          }
        } else if (t < a.n_tok) {
          out[(out0 + t) * stride + r] = acc[i];
        }
      }
      return;
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t)
    for (int o = wl >> 1; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
  if (a.lpr > 32) {
    __shared__ float part[kStoreWarps][NT];
    const int warp = static_cast<int>(threadIdx.x >> 5);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t) part[warp][t] = acc[t];
    }
    __syncthreads();
    if (sl == 0) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        float v = part[warp][t] + part[warp + 1][t];
        if (a.lpr == 128) v = v + (part[warp + 2][t] + part[warp + 3][t]);
        acc[t] = v;
      }
    }
    __syncthreads();  // part is reused by the caller's next rows
  }
  if (active && sl == 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if constexpr (kGroup) {
        if (t < g->n) out[g->out[t] * stride + r] = acc[t];
      } else if (NT == 1 || t < a.n_tok) {
        out[(out0 + t) * stride + r] = acc[t];
      }
    }
  }
}

// ---- K-quant decode GEMV (Q4_K, Q5_K, Q6_K) ------------------------------------------------
// A lane owns 64-element units of a row, every loaded weight byte used by that lane:
//  Q4_K / Q5_K: unit u = the 32-byte chunk c = u & 3 of superblock u >> 2 (elements 64u..64u+63:
//    group 2u in the low nibbles, group 2u + 1 in the high ones; Q5_K adds bits 2c, 2c+1 of qh),
//    loaded with the superblock's 16-byte header (d, dmin, the 12 scale bytes) in 16-byte loads;
//    a group contributes x.d * (d*s * dot) + (-dmin*m) * x.sum (the activations' group sum,
//    meta .w);
//  Q6_K: unit u = (half h, 16-element column range hf) of superblock u >> 2: 16 elements of
//    each of the half's four 32-element groups (ql, qh bytes 2-byte aligned: 4-byte loads and
//    funnel shifts), q - 32 as a signed byte, so a piece contributes x.d * (d*s8 * dot).
// Each lane set (lpr lanes) computes rps rows at once: per step, the loads of every row's unit
// first (load_kq_raw), then each unit decoded and multiplied in turn. A row's arithmetic depends on
// lpr (from n_in) only, never on rps or the number of tokens: the sum of its units in lane-strided
// order, then the butterfly.
constexpr bool is_kq(GgmlType t) {
  return t == GgmlType::Q4_K || t == GgmlType::Q5_K || t == GgmlType::Q6_K;
}

// A decoded unit: q bytes (Q4_K/Q5_K: words 0-7 group 2u, 8-15 group 2u+1, unsigned; Q6_K: words
// 4k..4k+3 piece k, signed), the pieces' scales, and (Q4_K/Q5_K) the groups' offsets.
struct KqUnit {
  uint32_t q[16];
  float sc[4];
  float mn[2];
};

// A unit's bytes as loaded, before decoding: a lane set issues the loads of all its rows' units
// (load_kq_raw) before it decodes any (decode_kq_raw), so only one decoded unit is live at a time.
// Q4_K / Q5_K: the superblock header, the unit's 32 quant bytes (and Q5_K's 32 high-bit bytes);
// Q6_K: the five aligned words under each of the three 16-byte pieces (four aligned words and the
// next one when the piece is not 4-byte aligned, shifted by sh), the four 16-bit halves of the two
// scale words and d's bits.
template <GgmlType T>
struct KqRaw {
  uint4 hd, v0, v1, h0, h1;  // h0, h1: Q5_K only
};
template <>
struct KqRaw<GgmlType::Q6_K> {
  uint32_t w[3][5];
  unsigned sh;
  uint16_t s[4], d;
};

template <GgmlType T>
__device__ __forceinline__ void load_kq_raw(const uint8_t* row, int u, KqRaw<T>& r) {
  if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
    constexpr int kBytes = T == GgmlType::Q4_K ? 144 : 176;
    constexpr int kQs = T == GgmlType::Q4_K ? 16 : 48;
    const uint8_t* b = row + static_cast<size_t>(u >> 2) * kBytes;
    const int c = u & 3;
    r.hd = __ldg(reinterpret_cast<const uint4*>(b));
    r.v0 = __ldg(reinterpret_cast<const uint4*>(b + kQs + 32 * c));
    r.v1 = __ldg(reinterpret_cast<const uint4*>(b + kQs + 32 * c) + 1);
    if constexpr (T == GgmlType::Q5_K) {
      r.h0 = __ldg(reinterpret_cast<const uint4*>(b + 16));
      r.h1 = __ldg(reinterpret_cast<const uint4*>(b + 16) + 1);
    }
  } else {
    static_assert(T == GgmlType::Q6_K, "load_kq_raw: Q4_K, Q5_K or Q6_K");
    const uint8_t* b = row + static_cast<size_t>(u >> 2) * 210;
    const int h = (u >> 1) & 1, hf = u & 1;
    // The three pieces (ql low, ql high, qh) share their offset's alignment (they differ by
    // multiples of 4 bytes), so one shift serves all; the fifth word is read only
    // when the piece is not 4-byte aligned (nothing past the piece's last word).
    const uint8_t* p[3] = {b + 64 * h + 16 * hf, b + 64 * h + 32 + 16 * hf,
                           b + 128 + 32 * h + 16 * hf};
    r.sh = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p[0]) & 2) * 8;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const uint32_t* q =
          reinterpret_cast<const uint32_t*>(reinterpret_cast<uintptr_t>(p[k]) & ~uintptr_t{3});
#pragma unroll
      for (int i = 0; i < 4; ++i) r.w[k][i] = __ldg(q + i);
      r.w[k][4] = r.sh ? __ldg(q + 4) : 0u;
    }
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(b + 192 + 8 * h);
#pragma unroll
    for (int i = 0; i < 4; ++i) r.s[i] = sp[i];
    r.d = *reinterpret_cast<const uint16_t*>(b + 208);
  }
}

// The unit u decoded from its loaded bytes (the layout in KqUnit).
template <GgmlType T>
__device__ __forceinline__ void decode_kq_raw(const KqRaw<T>& r, int u, KqUnit& k) {
  if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
    const int c = u & 3;
    const uint4 hd = r.hd;
    const uint32_t v[8] = {r.v0.x, r.v0.y, r.v0.z, r.v0.w, r.v1.x, r.v1.y, r.v1.z, r.v1.w};
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      k.q[w] = v[w] & 0x0F0F0F0Fu;
      k.q[8 + w] = (v[w] >> 4) & 0x0F0F0F0Fu;
    }
    if constexpr (T == GgmlType::Q5_K) {
      const uint32_t hb[8] = {r.h0.x, r.h0.y, r.h0.z, r.h0.w, r.h1.x, r.h1.y, r.h1.z, r.h1.w};
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        k.q[w] |= ((hb[w] >> (2 * c)) & 0x01010101u) << 4;
        k.q[8 + w] |= ((hb[w] >> (2 * c + 1)) & 0x01010101u) << 4;
      }
    }
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(hd.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(hd.x >> 16)));
    // Scale bytes s[0..11] = header bytes 4..15 (words y, z, w); k_scale_min's unpacking.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = 2 * c + i, sh = 8 * (j & 3);
      const uint32_t sa = (hd.y >> sh) & 0xFFu, sb = (hd.z >> sh) & 0xFFu,
                     sc = (hd.w >> sh) & 0xFFu;
      const uint32_t scale = j < 4 ? (sa & 63u) : ((sc & 0xFu) | ((sa >> 6) << 4));
      const uint32_t mn = j < 4 ? (sb & 63u) : ((sc >> 4) | ((sb >> 6) << 4));
      k.sc[i] = d * static_cast<float>(scale);
      k.mn[i] = -dmin * static_cast<float>(mn);
    }
    k.sc[2] = k.sc[3] = 0.0f;
  } else {
    uint32_t qa[4], qb[4], qh[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      qa[i] = __funnelshift_r(r.w[0][i], r.w[0][i + 1], r.sh);
      qb[i] = __funnelshift_r(r.w[1][i], r.w[1][i + 1], r.sh);
      qh[i] = __funnelshift_r(r.w[2][i], r.w[2][i + 1], r.sh);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t lo = ((p & 1 ? qb[w] : qa[w]) >> (4 * (p >> 1))) & 0x0F0F0F0Fu;
        const uint32_t hi = (qh[w] >> (2 * p)) & 0x03030303u;
        k.q[4 * p + w] = __vsub4(lo | (hi << 4), 0x20202020u);  // q - 32, in [-32, 31]
      }
    // The pieces' scales: int8 at 192 + 8h + 2p + hf (h, hf from u).
    const int hf = u & 1;
    const uint32_t s01 = static_cast<uint32_t>(r.s[0]) | (static_cast<uint32_t>(r.s[1]) << 16);
    const uint32_t s23 = static_cast<uint32_t>(r.s[2]) | (static_cast<uint32_t>(r.s[3]) << 16);
    const float d = __half2float(__ushort_as_half(r.d));
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint32_t word = p < 2 ? s01 : s23;
      const int8_t s8 = static_cast<int8_t>((word >> (8 * (2 * (p & 1) + hf))) & 0xFFu);
      k.sc[p] = d * static_cast<float>(s8);
    }
    k.mn[0] = k.mn[1] = 0.0f;
  }
}

// The unit's dot product with token row ar of the 8-bit activations (xq, xm; n_in elements).
template <GgmlType T>
__device__ __forceinline__ float kq_dot(const KqUnit& k, const int8_t* __restrict__ xq,
                                        const float4* __restrict__ xm, int64_t ar, int64_t n_in,
                                        int u) {
  if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
    const uint4* xp = reinterpret_cast<const uint4*>(xq + ar * n_in + 64 * u);
    const float4* mp = xm + ar * (n_in / 32) + 2 * u;
    int s[2];
#pragma unroll
    for (int gi = 0; gi < 2; ++gi) {
      const uint4 x0 = __ldg(xp + 2 * gi), x1 = __ldg(xp + 2 * gi + 1);
      const uint32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      int acc = 0;
#pragma unroll
      for (int w = 0; w < 8; ++w)
        acc = __dp4a(static_cast<int>(k.q[8 * gi + w]), static_cast<int>(xv[w]), acc);
      s[gi] = acc;
    }
    const float4 m0 = __ldg(mp), m1 = __ldg(mp + 1);
    const float t0 =
        __fmaf_rn(m0.x, __fmul_rn(k.sc[0], static_cast<float>(s[0])), __fmul_rn(k.mn[0], m0.w));
    const float t1 =
        __fmaf_rn(m1.x, __fmul_rn(k.sc[1], static_cast<float>(s[1])), __fmul_rn(k.mn[1], m1.w));
    return __fadd_rn(t0, t1);
  } else {
    // Piece p: group 8(u >> 2) + 4h + p, its elements 16hf..16hf+15.
    const int64_t g0 = 8 * (u >> 2) + 4 * ((u >> 1) & 1);
    const int8_t* xr = xq + ar * n_in + 32 * g0 + 16 * (u & 1);
    const float4* mr = xm + ar * (n_in / 32) + g0;
    float t[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(xr + 32 * p));
      int acc = __dp4a(static_cast<int>(k.q[4 * p]), static_cast<int>(x.x), 0);
      acc = __dp4a(static_cast<int>(k.q[4 * p + 1]), static_cast<int>(x.y), acc);
      acc = __dp4a(static_cast<int>(k.q[4 * p + 2]), static_cast<int>(x.z), acc);
      acc = __dp4a(static_cast<int>(k.q[4 * p + 3]), static_cast<int>(x.w), acc);
      t[p] = __fmul_rn(__ldg(&mr[p].x), __fmul_rn(k.sc[p], static_cast<float>(acc)));
    }
    return __fadd_rn(__fadd_rn(t[0], t[1]), __fadd_rn(t[2], t[3]));
  }
}

// The rows of one K-quant GEMV block (gemv_q_block's contract; R = a.rps).
template <GgmlType T, int NT, int R, bool kGroup = false>
__device__ __forceinline__ void gemv_kq_block(const GemvArgs& a, const uint8_t* w, int64_t act0,
                                              int64_t out0, float* out,
                                              const GroupRows* g = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sl = lane & (a.lpr - 1);
  const int64_t set =
      (static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + warp) * (32 / a.lpr) + lane / a.lpr;
  const uint8_t* row[R];
  float* dst[R];
  int64_t rr[R], sd[R];
  bool on[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    int64_t r = set * R + i, n_out = a.n_out;
    const uint8_t* wi = w;
    float* oi = out;
    group_row(a, r, wi, oi, n_out);
    on[i] = r < n_out;
    rr[i] = r;
    row[i] = wi + static_cast<size_t>(on[i] ? r : 0) * a.row_bytes;
    dst[i] = oi;
    sd[i] = out_stride_of(a, n_out);
  }
  float acc[R][NT];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[i][t] = 0.0f;
  const int U = static_cast<int>(a.n_in / 64);
#pragma unroll(R == 1 ? 2 : 1)
  for (int u = sl; u < U; u += a.lpr) {
    // Every row's loads first (a row past the matrix reads row 0 of it; its sums are never
    // stored), then one decoded unit at a time.
    KqRaw<T> raw[R];
#pragma unroll
    for (int i = 0; i < R; ++i) load_kq_raw<T>(row[i], u, raw[i]);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      KqUnit k;
      decode_kq_raw<T>(raw[i], u, k);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if constexpr (kGroup) {
          if (t < g->n)
            acc[i][t] = __fadd_rn(acc[i][t], kq_dot<T>(k, a.xq, a.xm, g->act[t], a.n_in, u));
        } else if (NT == 1 || t < a.n_tok) {
          acc[i][t] = __fadd_rn(acc[i][t], kq_dot<T>(k, a.xq, a.xm, act0 + t, a.n_in, u));
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i)
    gemv_store<NT, kGroup>(a, acc[i], on[i], sl, out0, rr[i], dst[i], sd[i], g);
}

// The rows of one quantized GEMV block (w: the block's matrix, act0 / out0: its first
// activation and output rows, from gemv_setup; out: its output base, a.out or another). kGroup:
// the tokens are the pairs of `grp` (group_setup; NT = kMoeGroupTok), each pair's row summed as
// an ungrouped launch sums it.
template <GgmlType T, int NT, bool kGroup = false>
__device__ __forceinline__ void gemv_q_block(const GemvArgs& a, const uint8_t* w, int64_t act0,
                                             int64_t out0, float* out,
                                             const GroupRows* grp = nullptr) {
  static_assert(!kGroup || NT == kMoeGroupTok, "gemv_q_block: a group has kMoeGroupTok tokens");
  if constexpr (is_kq(T)) {
    if (a.kq) {
      if (a.rps == 2)
        gemv_kq_block<T, NT, 2, kGroup>(a, w, act0, out0, out, grp);
      else
        gemv_kq_block<T, NT, 1, kGroup>(a, w, act0, out0, out, grp);
      return;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rows_per_warp = 32 / a.lpr;
  const int sl = lane & (a.lpr - 1);
  int64_t r =
      (static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + warp) * rows_per_warp + lane / a.lpr;
  int64_t n_out = a.n_out;
  group_row(a, r, w, out, n_out);
  const bool active = r < n_out;
  const int G = static_cast<int>(a.n_in / 32);
  const uint8_t* row = w + static_cast<size_t>(active ? r : 0) * a.row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  if (active) {
#pragma unroll 2
    for (int g = sl; g < G; g += a.lpr) {
      const QGroup q = load_group<T>(row, g);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (kGroup ? t < grp->n : (NT == 1 || t < a.n_tok)) {
          const int64_t ar = kGroup ? grp->act[t] : act0 + t;
          const uint4* xp = reinterpret_cast<const uint4*>(a.xq + ar * a.n_in + 32 * g);
          const uint4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
          const float4 m = __ldg(a.xm + ar * G + g);
          int s0 = __dp4a(static_cast<int>(q.q[0]), static_cast<int>(x0.x), 0);
          s0 = __dp4a(static_cast<int>(q.q[1]), static_cast<int>(x0.y), s0);
          s0 = __dp4a(static_cast<int>(q.q[2]), static_cast<int>(x0.z), s0);
          s0 = __dp4a(static_cast<int>(q.q[3]), static_cast<int>(x0.w), s0);
          int s1 = __dp4a(static_cast<int>(q.q[4]), static_cast<int>(x1.x), 0);
          s1 = __dp4a(static_cast<int>(q.q[5]), static_cast<int>(x1.y), s1);
          s1 = __dp4a(static_cast<int>(q.q[6]), static_cast<int>(x1.z), s1);
          s1 = __dp4a(static_cast<int>(q.q[7]), static_cast<int>(x1.w), s1);
          // Rounding pinned with intrinsics (never contracted or reordered by the compiler), so
          // the one-token and the several-token instantiations give a row the same bits (with
          // plain operators nvcc fused the mins' products differently in the two for Q4_K).
          const float dot =
              __fmaf_rn(q.sc1, static_cast<float>(s1), __fmul_rn(q.sc0, static_cast<float>(s0)));
          const float mins = __fmaf_rn(q.m1, m.z, __fmul_rn(q.m0, m.y));
          acc[t] = __fadd_rn(acc[t], __fmaf_rn(m.x, dot, mins));
        }
      }
    }
  }
  gemv_store<NT, kGroup>(a, acc, active, sl, out0, r, out, out_stride_of(a, n_out), grp);
}

template <GgmlType T, int NT>
__global__ void __launch_bounds__(kThreads) gemv_q_kernel(GemvArgs a) {
  pdl_enter();
  const uint8_t* w;
  int64_t act0, out0;
  if (!gemv_setup(a, w, act0, out0)) return;  // uniform over the block
  gemv_q_block<T, NT>(a, w, act0, out0, a.out);
}

// gemv_q_kernel for 2-4 tokens (gemv_tok4()): 4 accumulators per row, compiled for at least 5
// resident blocks per SM (at most 102 registers: 96 for Q4_K without spills, small spills for
// Q5_K and Q6_K, against 126-128 registers and 4 blocks per SM for the 8-token instantiation).
template <GgmlType T>
__global__ void __launch_bounds__(kThreads, 5) gemv_q4_kernel(GemvArgs a) {
  pdl_enter();
  const uint8_t* w;
  int64_t act0, out0;
  if (!gemv_setup(a, w, act0, out0)) return;  // uniform over the block
  gemv_q_block<T, 4>(a, w, act0, out0, a.out);
}

// gemv_q_kernel's K-quant path alone, compiled for at least MINB resident blocks per SM
// (gemv_kq_minb(): single-token launches; the same instructions in another register allocation).
template <GgmlType T, int MINB>
__global__ void __launch_bounds__(kThreads, MINB) gemv_kq_kernel(GemvArgs a) {
  pdl_enter();
  const uint8_t* w;
  int64_t act0, out0;
  if (!gemv_setup(a, w, act0, out0)) return;  // uniform over the block
  if (a.rps == 2)
    gemv_kq_block<T, 1, 2>(a, w, act0, out0, a.out);
  else
    gemv_kq_block<T, 1, 1>(a, w, act0, out0, a.out);
}

// A routed GEMV grouped by expert (GemvRoute::groups): grid row y computes group y's pairs,
// each with the bits gemv_q_kernel<T, 1> gives it.
template <GgmlType T>
__global__ void __launch_bounds__(kThreads) gemv_group_kernel(GemvArgs a) {
  pdl_enter();
  const uint8_t* w;
  GroupRows g;
  if (!group_setup(a, w, g)) return;  // uniform over the block
  gemv_q_block<T, kMoeGroupTok, true>(a, w, 0, 0, a.out, &g);
}

// Whether this block is the last of `total` blocks to count at *count (the count's atomic add
// after a fence: every block's stores are then visible to the last one, which reads them through
// L2). Every thread of the block must call it.
__device__ __forceinline__ bool last_block(unsigned* count, unsigned total) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(count, 1u) == total - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// moe_experts' routed decode GEMVs with their neighbours folded in, one launch each instead of
// two or three, with the same bits (MoeGemvFuse in matmul_internal.h).
//  kDown false: gate (grid z 0, into a.out) and up (z 1: f.up_*); the last block of a pair to
//    finish writes the pair's down activations quantize(silu(G) * U), quantize_act's arithmetic.
//  kDown true: down; the last of the k pair blocks of a token's x block to finish writes the
//    token's out rows of that block: the sum over its valid slots, in slot order, of the route
//    weight times Y (moe_combine's arithmetic). Every block counts, skipped pairs too.
template <GgmlType T, bool kDown>
__global__ void __launch_bounds__(kThreads) moe_gemv_kernel(GemvArgs a, MoeGemvFuse f) {
  pdl_enter();
  // Grid z 1 (up) reads its own matrices and writes its own output; `a` is never written (a
  // written kernel parameter would be copied to local memory, and every read of it then loads).
  const bool up = !kDown && blockIdx.z == 1;
  const uint8_t* w;
  int64_t act0, out0;
  // Uniform over the block and over the pair.
  const bool run = gemv_setup_bytes(a, up ? f.up_w : a.w, up ? f.up_expert_bytes : a.r.expert_bytes,
                                    w, act0, out0);
  if (!kDown && !run) return;  // every block of this pair returns: nothing to quantize
  if (run) gemv_q_block<T, 1>(a, w, act0, out0, up ? f.up_out : a.out);
  const int64_t p = blockIdx.y;
  const int k = a.r.k;
  // The last block's loads are issued together (kBatch groups per warp, up to kMaxK slots per
  // row) before any use: one L2 round trip instead of one per group or slot.
  constexpr int kBatch = 8, kMaxK = 16;
  if constexpr (!kDown) {
    if (!last_block(f.count + p, 2 * gridDim.x)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n = a.n_out, groups = n / 32;
    const float* g = f.gate_out + p * a.out_stride;
    const float* u = f.up_out + p * a.out_stride;
    constexpr int kWarps = kThreads / 32;
    for (int64_t g0 = warp; g0 < groups; g0 += kWarps * kBatch) {
      float gv[kBatch], uv[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t grp = g0 + b * kWarps;
        if (grp < groups) {
          gv[b] = __ldcg(g + grp * 32 + lane);
          uv[b] = __ldcg(u + grp * 32 + lane);
        }
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t grp = g0 + b * kWarps;
        if (grp < groups) {
          const float v = silu(gv[b]) * uv[b];
          quantize_group(v, lane, f.aq + p * n + grp * 32, f.aqm + p * groups + grp);
        }
      }
    }
  } else {
    const int64_t t = p / k;
    if (!last_block(f.count + t * gridDim.x + blockIdx.x, static_cast<unsigned>(k))) return;
    const int64_t rpb = rows_per_block(a.lpr, a.rps);
    const int64_t r0 = blockIdx.x * rpb;
    const int64_t r1 = r0 + rpb < a.n_out ? r0 + rpb : a.n_out;
    const float* rw = a.r.route + t * 2 * k + k;
    for (int64_t r = r0 + threadIdx.x; r < r1; r += kThreads) {
      float acc = 0.0f;
      if (k <= kMaxK) {
        float wv[kMaxK], yv[kMaxK];
        bool ok[kMaxK];
#pragma unroll
        for (int j = 0; j < kMaxK; ++j) {
          ok[j] = j < k && route_expert(a.r, t, j) >= 0;
          if (ok[j]) {
            wv[j] = rw[j];
            yv[j] = __ldcg(a.out + (t * k + j) * a.out_stride + r);
          }
        }
#pragma unroll
        for (int j = 0; j < kMaxK; ++j)
          if (ok[j]) acc = __fmaf_rn(wv[j], yv[j], acc);
      } else {
        for (int j = 0; j < k; ++j) {
          if (route_expert(a.r, t, j) < 0) continue;
          acc = __fmaf_rn(rw[j], __ldcg(a.out + (t * k + j) * a.out_stride + r), acc);
        }
      }
      f.out[t * a.n_out + r] = acc;
    }
  }
}

// 8 consecutive weights from a 16-byte aligned address.
template <GgmlType T>
__device__ __forceinline__ void load8(const uint8_t* p, float* v) {
  if constexpr (T == GgmlType::F32) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const uint32_t wd[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (T == GgmlType::F16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&wd[i]));
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
      } else {
        v[2 * i] = __uint_as_float(wd[i] << 16);
        v[2 * i + 1] = __uint_as_float(wd[i] & 0xFFFF0000u);
      }
    }
  }
}

// One lane's share (lane sl of its row's a.lpr lanes) of a float-weight row's dot products
// with the NT tokens' activations (rows act0..): gemv_f_kernel's loop, shared with the fused
// router kernel so both give the same bits.
template <GgmlType T, int NT>
__device__ __forceinline__ void gemv_f_lane(const GemvArgs& a, const uint8_t* row, int64_t act0,
                                            int sl, float (&acc)[NT]) {
  int64_t done = 0;
  if (a.vec) {
    const int64_t C = a.n_in / 8;
    constexpr int kEs = T == GgmlType::F32 ? 4 : 2;
    // Unrolled so that several chunks' loads may be in flight; the sum keeps its order. (The
    // decode router, 128 x 2048 f32, stayed at 5.9 us on the H200: latency of 32 blocks.)
#pragma unroll 4
    for (int64_t c = sl; c < C; c += a.lpr) {
      float wv[8];
      load8<T>(row + c * 8 * kEs, wv);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (NT == 1 || t < a.n_tok) {
          const float4* xp = reinterpret_cast<const float4*>(a.xf + (act0 + t) * a.n_in + c * 8);
          const float4 x0 = __ldg(xp), x1 = __ldg(xp + 1);
          acc[t] += wv[0] * x0.x + wv[1] * x0.y + wv[2] * x0.z + wv[3] * x0.w + wv[4] * x1.x +
                    wv[5] * x1.y + wv[6] * x1.z + wv[7] * x1.w;
        }
      }
    }
    done = C * 8;
  }
  for (int64_t i = done + sl; i < a.n_in; i += a.lpr) {
    const float wv = float_elem<T>(row, i);
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (NT == 1 || t < a.n_tok) acc[t] += wv * a.xf[(act0 + t) * a.n_in + i];
  }
}

template <GgmlType T, int NT>
__global__ void __launch_bounds__(kThreads) gemv_f_kernel(GemvArgs a) {
  pdl_enter();
  const uint8_t* w;
  int64_t act0, out0;
  if (!gemv_setup(a, w, act0, out0)) return;
  // Lane sl of row r: thread g of the grid's row blocks, r = g / lpr, sl = g % lpr.
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int sl = static_cast<int>(g & (a.lpr - 1));
  int64_t r = g / a.lpr;
  int64_t n_out = a.n_out;
  float* out = a.out;
  group_row(a, r, w, out, n_out);
  const bool active = r < n_out;
  const uint8_t* row = w + static_cast<size_t>(active ? r : 0) * a.row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  if (active) gemv_f_lane<T, NT>(a, row, act0, sl, acc);
  gemv_store<NT>(a, acc, active, sl, out0, r, out, out_stride_of(a, n_out));
}

// ---- the decode router and its route in one launch (thread block cluster, sm_90) -------------
// A cluster of kRouterCluster blocks computes the router's logits (one token, float weights:
// each row as gemv_f_kernel computes it, so the same bits), writes them to a.out, and meets at
// the cluster barrier; block 0 then routes (route_one_token, the moe_route arithmetic) and
// copies `cp` to the host and releases the ready flag, as moe_route_signal does.
constexpr int kRouterCluster = 8;
constexpr int kRouterWarps = 16;

template <GgmlType T>
__global__ void __launch_bounds__(kRouterWarps * 32)
    router_route_kernel(GemvArgs a, int32_t k, bool norm, float* route, Copies cp, uint32_t* flag,
                        uint32_t value, const int32_t* forced) {
  pdl_enter();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ double route_ex[];  // [n_expert] doubles, then the logits [n_expert]
  float* logit_s = reinterpret_cast<float*>(route_ex + a.n_out);
  const int rank = static_cast<int>(cluster.block_rank());
  const int warp = threadIdx.x >> 5;
  // Lane sl of row r, as in gemv_f_kernel: thread g of the cluster, r = g / lpr (+ the rows of
  // earlier passes), sl = g % lpr. Every thread makes the same passes (gemv_store may meet).
  const int64_t g = static_cast<int64_t>(rank) * (kRouterWarps * 32) + threadIdx.x;
  const int sl = static_cast<int>(g & (a.lpr - 1));
  const int64_t per_pass = static_cast<int64_t>(kRouterCluster) * kRouterWarps * 32 / a.lpr;
  for (int64_t base = 0; base < a.n_out; base += per_pass) {
    const int64_t r = base + g / a.lpr;
    const bool active = r < a.n_out;
    float acc[1] = {0.0f};
    if (active) gemv_f_lane<T, 1>(a, a.w + static_cast<size_t>(r) * a.row_bytes, 0, sl, acc);
    gemv_store<1>(a, acc, active, sl, 0, r, a.out, a.out_stride);
  }
  __threadfence();
  cluster.sync();  // every block's logits are in a.out
  if (rank != 0) return;
  for (int64_t e = threadIdx.x; e < a.n_out; e += blockDim.x) logit_s[e] = __ldcg(a.out + e);
  __syncthreads();
  if (warp == 0)
    route_one_token(logit_s, static_cast<int32_t>(a.n_out), k, norm, route, route_ex, forced);
  __syncthreads();  // the route's stores are visible to the block's copies
  copy_out_and_signal(cp, flag, value);
#endif
}

// One thread per (row, 32-element group).
template <GgmlType T, class O>
__global__ void dequant_q_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_in,
                                 int64_t n_w_rows, const int32_t* __restrict__ rows, int64_t row0,
                                 int64_t n_rows, O* __restrict__ dst) {
  pdl_enter();
  const int64_t G = n_in / 32;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_rows * G) return;
  const int64_t i = idx / G, g = idx % G;
  const int64_t src = rows ? rows[i] : row0 + i;
  O* o = dst + i * n_in + g * 32;
  if (src < 0 || src >= n_w_rows) {
#pragma unroll
    for (int e = 0; e < 32; ++e) o[e] = from_f32<O>(0.0f);
    return;
  }
  const QGroup q = load_group<T>(w + static_cast<size_t>(src) * row_bytes, static_cast<int>(g));
  if constexpr (sizeof(O) == 2) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      __align__(16) __half h[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = __float2half_rn(group_value(q, 8 * c + e));
      reinterpret_cast<uint4*>(o)[c] = *reinterpret_cast<const uint4*>(h);
    }
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      reinterpret_cast<float4*>(o)[c] =
          make_float4(group_value(q, 4 * c), group_value(q, 4 * c + 1), group_value(q, 4 * c + 2),
                      group_value(q, 4 * c + 3));
  }
}

// One thread per element (float weight types).
template <GgmlType T, class O>
__global__ void dequant_f_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_in,
                                 int64_t n_w_rows, const int32_t* __restrict__ rows, int64_t row0,
                                 int64_t n_rows, O* __restrict__ dst) {
  pdl_enter();
  const int64_t total = n_rows * n_in;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / n_in, c = idx % n_in;
    const int64_t src = rows ? rows[i] : row0 + i;
    const float v = (src < 0 || src >= n_w_rows)
                        ? 0.0f
                        : float_elem<T>(w + static_cast<size_t>(src) * row_bytes, c);
    dst[idx] = from_f32<O>(v);
  }
}

__global__ void to_half_kernel(const float* __restrict__ x, int64_t n,
                               const int32_t* __restrict__ src_rows, int div,
                               const int32_t* __restrict__ count, __half* __restrict__ dst) {
  pdl_enter();
  const int64_t i = blockIdx.x;
  if (count && i >= *count) return;
  const int64_t s = src_rows ? src_rows[i] / div : i;
  const float* xr = x + s * n;
  __half* o = dst + i * n;
  for (int64_t c = threadIdx.x; c < n; c += blockDim.x) o[c] = __float2half_rn(xr[c]);
}

// Lanes per row: the largest power of two <= 32 that wastes at most 1/8 of the lane steps
// on a row of `units` groups.
int lanes_per_row(int64_t units) {
  int l = 32;
  while (l > 1) {
    const int64_t steps = (units + l - 1) / l;
    if ((steps * l - units) * 8 <= units) break;
    l >>= 1;
  }
  return l;
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Lanes per row and rows per lane set of a GEMV of n_out rows of n_in over grid_yz row
// blocks' worth of pairs (and matrices): K-quants through gemv_kq_block (64-element units, 2 rows
// per lane set once the launch has 512 blocks or more), others by 32-element groups (quantized)
// or 8-element steps (float), 1 row per lane set.
struct GemvShape {
  int lpr, rps;
  bool kq;
};
// Rows per lane set of the K-quant kernel for a launch of `rows` rows at lpr lanes per row over
// grid_yz row blocks' worth of pairs: 2 once the launch has 512 blocks of 2-row sets (a row's
// bits do not depend on it), unless gemv_kq_rps() forces it.
int kq_rps(int lpr, int64_t rows, int64_t grid_yz) {
  const int forced = gemv_kq_rps();
  if (forced == 1 || forced == 2) return forced;
  const int64_t blocks2 =
      static_cast<int64_t>(blocks_for(rows, static_cast<int>(rows_per_block(lpr, 2))));
  return blocks2 * grid_yz >= 512 ? 2 : 1;
}

// Row blocks (of 1-row lane sets) below which a K-quant matrix that is not routed gets more
// lanes per row (gemv_shape): about two blocks per SM of an H200 (132 SMs).
constexpr int64_t kKqFillBlocks = 256;

GemvShape gemv_shape(GgmlType type, int64_t n_in, int64_t n_out, int64_t grid_yz, bool routed) {
  if (is_kq(type) && gemv_kq()) {
    // Lanes per row, from the matrix's shape alone (so a row's bits never depend on the launch):
    // by default the group kernel's rule (the most lanes, up to 32, that leave at most 1/8 of the
    // lane steps idle), then, for a matrix that is not routed and would fill fewer than
    // kKqFillBlocks blocks of 1-row sets, doubled while that holds and the lanes stay within the
    // unit count rounded up to a power of two (Qwen3.5-0.8B's ffn_down, 1024 rows of 56 units:
    // 8 lanes, 64 blocks on 132 SMs, become 32 lanes, 256 blocks). A routed matrix's launch has a
    // row block per pair, so it keeps the first rule. gemv_kq_lanes() 1: 32, or the unit count
    // rounded up to a power of two when smaller; 2: the first rule alone (measured in
    // docs/performance.md).
    const int64_t units = n_in / 64;
    int lpr = lanes_per_row(units);
    if (gemv_kq_lanes() == 1) {
      lpr = 1;
      while (lpr < 32 && lpr < units) lpr <<= 1;
    } else if (gemv_kq_lanes() == 0 && !routed) {
      while (lpr < 32 && lpr < units &&
             static_cast<int64_t>(blocks_for(n_out, static_cast<int>(rows_per_block(lpr, 1)))) <
                 kKqFillBlocks)
        lpr <<= 1;
    }
    return {lpr, kq_rps(lpr, n_out, grid_yz), true};
  }
  if (is_quantized(type)) return {lanes_per_row(n_in / 32), 1, false};
  // Float weights: a row of at least 512 eight-element steps in a matrix of at most 256 rows
  // (ssm_alpha / ssm_beta, 48 x 5120 f32 in Qwen3.5-27B: 12 blocks of 4 rows otherwise) spans
  // 128 lanes, 4 steps or more each.
  const int64_t units = std::max<int64_t>(1, n_in / 8);
  const int lpr = lanes_per_row(units);
  // (From n_out alone, not the launch's pairs: a routed row's bits must not follow the token
  // count.)
  if (lpr == 32 && units >= 4 * 128 && n_out <= 256) return {128, 1, false};
  return {lpr, 1, false};
}

// The arguments of a GEMV launch (gemv(), router_route_signal()).
GemvArgs gemv_args(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* xf,
                   QAct qa, int64_t n_tok, float* out, int64_t out_stride, const GemvRoute& route) {
  GemvArgs a{};
  a.w = static_cast<const uint8_t*>(w);
  a.row_bytes = row_bytes(type, n_in);
  a.n_in = n_in;
  a.n_out = n_out;
  a.xf = xf;
  a.xq = qa.q;
  a.xm = qa.meta;
  a.n_tok = static_cast<int>(n_tok);
  a.out = out;
  a.out_stride = out_stride;
  a.r = route;
  const bool q = is_quantized(type);
  const GemvShape sh = gemv_shape(type, n_in, n_out, route.route ? route.pairs : 1, route.route);
  a.lpr = sh.lpr;
  a.rps = sh.rps;
  a.kq = sh.kq;
  a.vec = !q && n_in % 8 == 0 && (reinterpret_cast<uintptr_t>(w) & 15) == 0 &&
          (reinterpret_cast<uintptr_t>(xf) & 15) == 0;
  if (!q && route.route) a.vec = a.vec && route.expert_bytes % 16 == 0;
  return a;
}

template <GgmlType T>
void launch_gemv_t(const GemvArgs& a, dim3 grid, cudaStream_t s) {
  if constexpr (is_float_type(T)) {
    launch("gemv_f_kernel", a.n_tok == 1 ? gemv_f_kernel<T, 1> : gemv_f_kernel<T, kGemvTok>, grid,
           kThreads, 0, s, a);
  } else {
    if (a.r.groups) {
      launch("gemv_group_kernel", gemv_group_kernel<T>, grid, kThreads, 0, s, a);
      return;
    }
    if constexpr (is_kq(T)) {
      if (a.kq && a.n_tok == 1 && gemv_kq_minb() != 0) {
        launch("gemv_kq_kernel", gemv_kq_minb() == 7 ? gemv_kq_kernel<T, 7> : gemv_kq_kernel<T, 8>,
               grid, kThreads, 0, s, a);
        return;
      }
    }
    if (a.n_tok > 1 && a.n_tok <= 4 && gemv_tok4()) {
      launch("gemv_q4_kernel", gemv_q4_kernel<T>, grid, kThreads, 0, s, a);
      return;
    }
    launch("gemv_q_kernel", a.n_tok == 1 ? gemv_q_kernel<T, 1> : gemv_q_kernel<T, kGemvTok>, grid,
           kThreads, 0, s, a);
  }
}

template <GgmlType T>
void launch_moe_gemv_t(const GemvArgs& a, const MoeGemvFuse& f, bool down, dim3 grid,
                       cudaStream_t s) {
  if constexpr (!is_float_type(T))
    launch("moe_gemv_kernel", down ? moe_gemv_kernel<T, true> : moe_gemv_kernel<T, false>, grid,
           kThreads, 0, s, a, f);
}

template <GgmlType T>
void launch_router_t(const GemvArgs& a, int32_t k, bool norm, float* route, const Copies& cp,
                     uint32_t* flag, uint32_t value, size_t smem, cudaStream_t s,
                     const int32_t* forced) {
  if constexpr (is_float_type(T))
    launch_in_clusters("router_route_kernel", router_route_kernel<T>, dim3(kRouterCluster),
                       kRouterWarps * 32, smem, s, kRouterCluster, a, k, norm, route, cp, flag,
                       value, forced);
}

template <GgmlType T>
void launch_dequant_t(const void* w, int64_t n_in, int64_t n_w_rows, const int32_t* rows,
                      int64_t row0, int64_t n_rows, void* dst, bool half_out, cudaStream_t s) {
  const auto* wb = static_cast<const uint8_t*>(w);
  const size_t rb = row_bytes(T, n_in);
  if constexpr (is_float_type(T)) {
    const int64_t total = n_rows * n_in;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(blocks_for(total, 256), 1 << 20));
    if (half_out)
      launch("dequant_f_kernel", dequant_f_kernel<T, __half>, grid, 256, 0, s, wb, rb, n_in,
             n_w_rows, rows, row0, n_rows, static_cast<__half*>(dst));
    else
      launch("dequant_f_kernel", dequant_f_kernel<T, float>, grid, 256, 0, s, wb, rb, n_in,
             n_w_rows, rows, row0, n_rows, static_cast<float*>(dst));
  } else {
    const unsigned grid = blocks_for(n_rows * (n_in / 32), 128);
    if (half_out)
      launch("dequant_q_kernel", dequant_q_kernel<T, __half>, grid, 128, 0, s, wb, rb, n_in,
             n_w_rows, rows, row0, n_rows, static_cast<__half*>(dst));
    else
      launch("dequant_q_kernel", dequant_q_kernel<T, float>, grid, 128, 0, s, wb, rb, n_in,
             n_w_rows, rows, row0, n_rows, static_cast<float*>(dst));
  }
}

}  // namespace

void quantize_act(const float* x, const float* up, int64_t rows, int64_t n, QAct qa, cudaStream_t s,
                  unsigned* zero, int64_t n_zero) {
  const int64_t groups = rows * (n / 32);
  if (groups == 0 && n_zero == 0) return;
  launch("quantize_act_kernel", quantize_act_kernel<false>,
         blocks_for(std::max(groups * 32, n_zero), 256), 256, 0, s, x, up, groups, qa.q, qa.meta,
         zero, n_zero);
}

void gemv(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* xf, QAct qa,
          int64_t n_tok, float* out, int64_t out_stride, const GemvRoute& route, cudaStream_t s) {
  if (n_out == 0 || n_tok == 0 || (route.route && route.pairs == 0)) return;
  BERTH_CHECK(n_tok <= kGemvTok, "gemv: n_tok " + std::to_string(n_tok));
  BERTH_CHECK(!route.groups || (is_quantized(type) && route.route && !route.by_slot && n_tok == 1),
              "gemv: groups of pairs need quantized weights and a route by expert");
  const GemvArgs a = gemv_args(type, w, n_in, n_out, xf, qa, n_tok, out, out_stride, route);
  dim3 grid(blocks_for(n_out, static_cast<int>(rows_per_block(a.lpr, a.rps))),
            route.route ? static_cast<unsigned>(route.pairs) : 1u);
  BERTH_DISPATCH(type, launch_gemv_t, a, grid, s)
}

bool gemv_one_token_lanes_agree(const MatmulJob* jobs, int n_jobs, int64_t n_in) {
  const int lpr = gemv_shape(jobs[0].type, n_in, jobs[0].n_out, 1, false).lpr;
  // Float jobs also agree on 16-byte loads (gemv_args' vec): a group takes them only when every
  // matrix is 16-byte aligned, so all or none of them must be.
  const bool aligned0 = (reinterpret_cast<uintptr_t>(jobs[0].w) & 15) == 0;
  for (int j = 0; j < n_jobs; ++j) {
    if (gemv_shape(jobs[j].type, n_in, jobs[j].n_out, 1, false).lpr != lpr) return false;
    if (!is_quantized(jobs[j].type) &&
        ((reinterpret_cast<uintptr_t>(jobs[j].w) & 15) == 0) != aligned0)
      return false;
  }
  return true;
}

void gemv_one_token(const MatmulJob* jobs, int n_jobs, int64_t n_in, QAct qa, const float* x,
                    cudaStream_t s, int64_t n_tok) {
  if (n_jobs < 1 || n_jobs > 3) throw Error(ErrorCategory::internal, "gemv_one_token: n_jobs");
  if (n_tok < 1 || n_tok > kGemvTok)
    throw Error(ErrorCategory::internal, "gemv_one_token: n_tok " + std::to_string(n_tok));
  const GgmlType type = jobs[0].type;
  GemvArgs a{};
  a.w = static_cast<const uint8_t*>(jobs[0].w);
  a.row_bytes = row_bytes(type, n_in);
  a.n_in = n_in;
  a.n_out = jobs[0].n_out;
  a.xf = x;
  a.xq = qa.q;
  a.xm = qa.meta;
  a.n_tok = static_cast<int>(n_tok);
  a.out = jobs[0].out;
  // Every job's output is [n_tok, its n_out] (out_stride_of).
  a.out_stride = jobs[0].n_out;
  int64_t total = jobs[0].n_out;
  for (int j = 1; j < n_jobs; ++j) {
    BERTH_CHECK(jobs[j].type == type, "gemv_one_token: one weight type");
    a.w_more[j - 1] = static_cast<const uint8_t*>(jobs[j].w);
    a.out_more[j - 1] = jobs[j].out;
    a.rows_more[j - 1] = jobs[j].n_out;
    total += jobs[j].n_out;
  }
  a.n_more = n_jobs - 1;
  if (!is_quantized(type)) {
    BERTH_CHECK(x != nullptr, "gemv_one_token: float weights need x");
    a.vec = n_in % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    for (int j = 0; j < n_jobs; ++j)
      a.vec = a.vec && (reinterpret_cast<uintptr_t>(jobs[j].w) & 15) == 0;
  }
  // Lanes per row from the matrices (each alone gets the same: gemv_one_token_lanes_agree), rows
  // per lane set from the launch.
  const GemvShape sh = gemv_shape(type, n_in, jobs[0].n_out, 1, false);
  a.lpr = sh.lpr;
  a.rps = sh.kq ? kq_rps(sh.lpr, total, 1) : sh.rps;
  a.kq = sh.kq;
  if (total == 0) return;
  const dim3 grid(blocks_for(total, static_cast<int>(rows_per_block(a.lpr, a.rps))), 1u);
  BERTH_DISPATCH(type, launch_gemv_t, a, grid, s)
}

int64_t moe_gemv_counts(GgmlType down_type, int64_t n_ff, int64_t n_embd, int64_t n_tok,
                        int64_t pairs) {
  // moe_gemv_down's grid (gemv_args with a route of `pairs` pairs).
  const GemvShape sh = gemv_shape(down_type, n_ff, n_embd, pairs, true);
  return pairs + n_tok * static_cast<int64_t>(
                             blocks_for(n_embd, static_cast<int>(rows_per_block(sh.lpr, sh.rps))));
}

void moe_gemv_gate_up(GgmlType type, const void* gate, const void* up, size_t up_expert_bytes,
                      int64_t n_embd, int64_t n_ff, QAct hq, float* G, float* U, QAct aq,
                      unsigned* count, const GemvRoute& r, cudaStream_t s) {
  BERTH_CHECK(is_quantized(type) && n_ff % 32 == 0 && r.route, "moe_gemv_gate_up: arguments");
  if (n_ff == 0 || r.pairs == 0) return;
  const GemvArgs a = gemv_args(type, gate, n_embd, n_ff, nullptr, hq, 1, G, n_ff, r);
  MoeGemvFuse f;
  f.up_w = static_cast<const uint8_t*>(up);
  f.up_expert_bytes = up_expert_bytes;
  f.gate_out = G;
  f.up_out = U;
  f.aq = aq.q;
  f.aqm = aq.meta;
  f.count = count;
  const dim3 grid(blocks_for(n_ff, static_cast<int>(rows_per_block(a.lpr, a.rps))),
                  static_cast<unsigned>(r.pairs), 2u);
  BERTH_DISPATCH(type, launch_moe_gemv_t, a, f, false, grid, s)
}

void moe_gemv_down(GgmlType type, const void* down, int64_t n_ff, int64_t n_embd, QAct aq, float* Y,
                   float* out, unsigned* count, const GemvRoute& r, cudaStream_t s) {
  BERTH_CHECK(is_quantized(type) && r.route && r.act_div == 1, "moe_gemv_down: arguments");
  if (n_embd == 0 || r.pairs == 0) return;
  const GemvArgs a = gemv_args(type, down, n_ff, n_embd, nullptr, aq, 1, Y, n_embd, r);
  MoeGemvFuse f;
  f.out = out;
  f.count = count;
  const dim3 grid(blocks_for(n_embd, static_cast<int>(rows_per_block(a.lpr, a.rps))),
                  static_cast<unsigned>(r.pairs), 1u);
  BERTH_DISPATCH(type, launch_moe_gemv_t, a, f, true, grid, s)
}

void dequant_rows(GgmlType type, const void* w, int64_t n_in, int64_t n_w_rows, const int32_t* rows,
                  int64_t row0, int64_t n_rows, void* dst, bool half_out, cudaStream_t s) {
  if (n_rows == 0 || n_in == 0) return;
  BERTH_DISPATCH(type, launch_dequant_t, w, n_in, n_w_rows, rows, row0, n_rows, dst, half_out, s)
}

void to_half(const float* x, int64_t rows, int64_t n, const int32_t* src_rows, int div,
             const int32_t* count, void* dst, cudaStream_t s) {
  if (rows == 0 || n == 0) return;
  launch("to_half_kernel", to_half_kernel, static_cast<unsigned>(rows), 256, 0, s, x, n, src_rows,
         div, count, static_cast<__half*>(dst));
}

}  // namespace detail

void router_route_signal(GgmlType type, const void* w, int64_t n_in, const float* x,
                         int32_t n_expert, int32_t k, bool norm, float* logits, float* route,
                         const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                         cudaStream_t s, const int32_t* forced) {
  if (!is_float_type(type))
    throw Error(ErrorCategory::invalid_argument,
                "gpu::router_route_signal: router weights of type " + std::string(type_name(type)) +
                    " (a float type is required)");
  detail::check_type(type, n_in, "gpu::router_route_signal");
  check_route(n_expert, k);
  const Copies cp = pack_copies(copies, n, "gpu::router_route_signal");
  const size_t smem = static_cast<size_t>(n_expert) * (sizeof(double) + sizeof(float));
  // (48 KiB of shared memory per block without opting in, less the static part: gemv_store's
  // sums, kStoreWarps floats.)
  if (!cluster_kernels_available() || smem + detail::kStoreWarps * sizeof(float) > 48 * 1024) {
    detail::gemv(type, w, n_in, n_expert, x, detail::QAct{}, 1, logits, n_expert,
                 detail::GemvRoute{}, s);
    moe_route_signal(logits, n_expert, k, norm, route, copies, n, flag, value, s, forced);
    return;
  }
  const detail::GemvArgs a = detail::gemv_args(type, w, n_in, n_expert, x, detail::QAct{}, 1,
                                               logits, n_expert, detail::GemvRoute{});
  BERTH_DISPATCH(type, detail::launch_router_t, a, k, norm, route, cp, flag, value, smem, s, forced)
}

using namespace detail;

namespace {

constexpr size_t kChunkBytes = size_t{64} << 20;  // dequantized f16 weights per GEMM call

// gemm_f16_kernel: out [M, ldc] (columns [0, N)) = X [M, K] . W [N, K]^T, both f16 row-major (K
// contiguous). A block computes a kGM x kGN tile with 4 warps of 32 x 32 (2 x 2 WMMA fragments
// of 16 x 16 x 16); X and W tiles of kGK columns are staged in shared memory, zero-padded past
// M, N and K (a zero adds nothing to any row). `vec`: K % 8 == 0 and 16-byte aligned pointers,
// so 8 halves travel per load.
constexpr int kGM = 64, kGN = 64, kGK = 32, kGLd = kGK + 8;
constexpr int kGemmThreads = 128;

template <bool kVec>
__device__ __forceinline__ void gemm_stage(const __half* __restrict__ src, int64_t rows, int64_t K,
                                           int64_t r0, int64_t k0, __half* dst, int tid) {
  if constexpr (kVec) {
    for (int i = tid; i < kGM * (kGK / 8); i += kGemmThreads) {
      const int r = i / (kGK / 8), c = (i % (kGK / 8)) * 8;
      const int64_t gr = r0 + r, gk = k0 + c;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (gr < rows && gk < K) v = __ldg(reinterpret_cast<const uint4*>(src + gr * K + gk));
      *reinterpret_cast<uint4*>(dst + r * kGLd + c) = v;
    }
  } else {
    for (int i = tid; i < kGM * kGK; i += kGemmThreads) {
      const int r = i / kGK, c = i % kGK;
      const int64_t gr = r0 + r, gk = k0 + c;
      dst[r * kGLd + c] = gr < rows && gk < K ? src[gr * K + gk] : __float2half_rn(0.0f);
    }
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kGemmThreads)
    gemm_f16_kernel(const __half* __restrict__ x, const __half* __restrict__ w, int64_t M,
                    int64_t N, int64_t K, float* __restrict__ out, int64_t ldc) {
  namespace wmma = nvcuda::wmma;
  pdl_enter();
  __shared__ __align__(128) __half As[kGM * kGLd];
  __shared__ __align__(128) __half Bs[kGN * kGLd];
  __shared__ __align__(128) float Cs[kGemmThreads / 32][16 * 16];
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kGM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kGN;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kGK) {
    gemm_stage<kVec>(x, M, K, m0, k0, As, tid);
    gemm_stage<kVec>(w, N, K, n0, k0, Bs, tid);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kGK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(fa[i], As + (wm + 16 * i) * kGLd + kk, kGLd);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fb[j], Bs + (wn + 16 * j) * kGLd + kk, kGLd);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* cs = Cs[warp];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(cs, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int e = lane; e < 256; e += 32) {
        const int64_t m = m0 + wm + 16 * i + e / 16, n = n0 + wn + 16 * j + e % 16;
        if (m < M && n < N) out[m * ldc + n] = cs[e];
      }
      __syncwarp();
    }
}

void gemm_f16(const __half* x, const __half* w, int64_t M, int64_t N, int64_t K, float* out,
              int64_t ldc, cudaStream_t s) {
  if (M == 0 || N == 0) return;
  if ((M + kGM - 1) / kGM > 65535)
    throw Error(ErrorCategory::invalid_argument, "matmul: " + std::to_string(M) +
                                                     " prompt rows in one call (at most " +
                                                     std::to_string(65535 * kGM) + ")");
  const dim3 grid(static_cast<unsigned>((N + kGN - 1) / kGN),
                  static_cast<unsigned>((M + kGM - 1) / kGM));
  const bool vec = K % 8 == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(w) & 15) == 0;
  if (vec)
    launch("gemm_f16_kernel", gemm_f16_kernel<true>, grid, kGemmThreads, 0, s, x, w, M, N, K, out,
           ldc);
  else
    launch("gemm_f16_kernel", gemm_f16_kernel<false>, grid, kGemmThreads, 0, s, x, w, M, N, K, out,
           ldc);
}

// Rows of one dequantized f16 chunk: a multiple of 64 when the matrix takes several chunks, so
// every chunk's GEMM starts at an output column offset of 256 bytes with a row count a multiple
// of 8. (Chunks of 6553 rows at n_in 5120 left cuBLAS misaligned output pointers and odd m:
// Qwen3.5-27B's prompt FFN GEMMs ran at about 90 TFLOP/s, docs/performance.md.)
int64_t chunk_rows(int64_t n_in, int64_t n_out) {
  int64_t per = std::max<int64_t>(1, static_cast<int64_t>(kChunkBytes) / (n_in * 2));
  if (per < n_out) per = std::max<int64_t>(64, per / 64 * 64);
  return std::min(n_out, per);
}

}  // namespace

bool supports(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::Q8_0:
    case GgmlType::Q2_K:
    case GgmlType::Q3_K:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

namespace {

constexpr size_t kCublasWs = size_t{32} << 20;  // cuBLAS workspace (its Hopper recommendation)

#define BERTH_CUBLAS_CHECK(call)                                                              \
  do {                                                                                        \
    cublasStatus_t berth_st_ = (call);                                                        \
    if (berth_st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      throw Error(ErrorCategory::internal,                                                    \
                  std::string("cuBLAS: ") + #call + ": " + cublasGetStatusString(berth_st_)); \
  } while (0)

// One handle per (device, stream), created on first use; the map is guarded by a mutex.
// Handles live until the process ends (a stream whose address is reused gets the same handle
// back, re-bound to it below).
cublasHandle_t cublas_handle(cudaStream_t s) {
  int dev = 0;
  BERTH_CUDA_CHECK(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, cublasHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  cublasHandle_t& h = handles[{dev, s}];
  if (h == nullptr) BERTH_CUBLAS_CHECK(cublasCreate(&h));
  BERTH_CUBLAS_CHECK(cublasSetStream(h, s));
  return h;
}

// The decode rows of a matmul call (matmul's n_decode, resolved).
int64_t matmul_decode_rows(GgmlType type, int64_t n_tok, int64_t n_decode, const char* what) {
  if (n_decode < -1 || n_decode > n_tok)
    throw Error(ErrorCategory::invalid_argument, std::string(what) + ": " +
                                                     std::to_string(n_decode) + " decode rows of " +
                                                     std::to_string(n_tok));
  if (n_decode >= 0) return n_decode;
  return matmul_uses_gemv(type, n_tok) ? n_tok : 0;
}
// The rows the GEMV computes: the decode rows, and with F32 weights every row (their prompt rows
// keep f32 activations, as the CPU path does, instead of rounding them to f16 for the GEMM).
// Only where prompt rows must be invariant: in launches of 8 rows the GEMV is slow for a long
// prompt (a q4_k_m file's F32 router matrices: 45 ms of a 512-token ubatch, against cuBLAS's
// share of 6 ms), so a session of one sequence takes the tensor-core path for them.
int64_t gemv_rows(GgmlType type, int64_t n_tok, int64_t n_dec, bool invariant) {
  return type == GgmlType::F32 && invariant ? n_tok : n_dec;
}

// The workspace of a call: the decode rows' 8-bit activations first (matmul_group's x_q8 reads
// them at the start), then the prompt rows' f16 activations, then a chunk of f16 weights.
struct MatmulWs {
  size_t q8 = 0, xh = 0, cublas = 0, wh = 0;
  size_t total() const { return q8 + xh + cublas + wh; }
};
MatmulWs matmul_ws(GgmlType type, int64_t n_in, int64_t n_out, int64_t n_tok, int64_t n_dec,
                   bool invariant) {
  MatmulWs m;
  if (n_tok <= 0 || n_out <= 0 || n_in == 0) return m;
  const int64_t n_pre = n_tok - n_dec;
  if (n_dec > 0 && is_quantized(type)) m.q8 = align_up(qact_bytes(n_dec, n_in));
  if (n_pre > 0) {
    m.xh = align_up(static_cast<size_t>(n_pre * n_in) * 2);
    if (!invariant) m.cublas = kCublasWs;
    if (type != GgmlType::F16)
      m.wh = align_up(static_cast<size_t>(chunk_rows(n_in, n_out) * n_in) * 2);
  }
  return m;
}

}  // namespace

size_t matmul_workspace_bytes(GgmlType type, int64_t n_in, int64_t n_out, int64_t n_tok,
                              int64_t n_decode, bool invariant) {
  check_type(type, n_in, "matmul_workspace_bytes");
  if (n_tok <= 0) return 0;
  const int64_t n_dec = matmul_decode_rows(type, n_tok, n_decode, "matmul_workspace_bytes");
  return matmul_ws(type, n_in, n_out, n_tok, gemv_rows(type, n_tok, n_dec, invariant), invariant)
      .total();
}

void matmul(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* x,
            int64_t n_tok, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
            int64_t n_decode, bool invariant) {
  check_type(type, n_in, "matmul");
  if (n_tok <= 0 || n_out <= 0) return;
  const int64_t n_dec =
      gemv_rows(type, n_tok, matmul_decode_rows(type, n_tok, n_decode, "matmul"), invariant);
  const int64_t n_pre = n_tok - n_dec;
  const MatmulWs L = matmul_ws(type, n_in, n_out, n_tok, n_dec, invariant);
  const size_t need = L.total();
  if (workspace_bytes < need || (need > 0 && workspace == nullptr))
    throw Error(ErrorCategory::invalid_argument, "matmul: workspace of " +
                                                     std::to_string(workspace_bytes) + " bytes, " +
                                                     std::to_string(need) + " needed");
  if (n_in == 0) {
    BERTH_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n_tok * n_out) * 4, stream));
    return;
  }
  auto* ws = static_cast<uint8_t*>(workspace);
  if (n_pre > 0) {
    // Prompt rows, f16 activations. Invariant calls: the mma.sync GEMM decoding the weights in
    // shared memory where it applies, else the WMMA GEMM on f16 weight chunks; one sequence:
    // cuBLAS on the chunks.
    auto* xh = reinterpret_cast<__half*>(ws + L.q8);
    auto* wh = reinterpret_cast<__half*>(ws + L.q8 + L.xh + L.cublas);
    to_half(x, n_pre, n_in, nullptr, 1, nullptr, xh, stream);
    // (The f16 weight chunk stays reserved when the mma.sync GEMM applies: the workspace's size
    // then does not depend on the device or the moe_gemm_mma switch at sizing time.)
    if (invariant && dense_gemm_mma_applies(n_in, n_pre, n_out) &&
        (reinterpret_cast<uintptr_t>(xh) & 15) == 0) {
      dense_gemm_mma(type, w, n_in, n_out, xh, n_pre, out, stream);
    } else {
      cublasHandle_t h = nullptr;
      if (!invariant) {
        h = cublas_handle(stream);
        BERTH_CUBLAS_CHECK(cublasSetWorkspace(h, ws + L.q8 + L.xh, kCublasWs));
      }
      const int64_t step = type == GgmlType::F16 ? n_out : chunk_rows(n_in, n_out);
      for (int64_t r0 = 0; r0 < n_out; r0 += step) {
        const int64_t rows = std::min(step, n_out - r0);
        const __half* a = static_cast<const __half*>(w) + (type == GgmlType::F16 ? r0 * n_in : 0);
        if (type != GgmlType::F16) {
          dequant_rows(type, w, n_in, n_out, nullptr, r0, rows, wh, true, stream);
          a = wh;
        }
        if (invariant) {
          gemm_f16(xh, a, n_pre, rows, n_in, out + r0, n_out, stream);
        } else {
          // Column-major view: C [rows x n_pre] (ldc n_out) = A^T (A: n_in x rows) * B (n_in x
          // n_pre).
          const float alpha = 1.0f, beta = 0.0f;
          BERTH_CUBLAS_CHECK(cublasGemmEx(
              h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows), static_cast<int>(n_pre),
              static_cast<int>(n_in), &alpha, a, CUDA_R_16F, static_cast<int>(n_in), xh, CUDA_R_16F,
              static_cast<int>(n_in), &beta, out + r0, CUDA_R_32F, static_cast<int>(n_out),
              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      }
    }
  }
  if (n_dec > 0) {
    // Decode rows: the GEMV, kGemvTok rows per launch.
    const float* xd = x + n_pre * n_in;
    float* od = out + n_pre * n_out;
    QAct qa{};
    if (is_quantized(type)) {
      qa = qact_at(ws, n_dec, n_in);
      quantize_act(xd, nullptr, n_dec, n_in, qa, stream);
    }
    for (int64_t t0 = 0; t0 < n_dec; t0 += kGemvTok) {
      const int64_t nt = std::min<int64_t>(kGemvTok, n_dec - t0);
      QAct part{};
      if (qa.q) part = {qa.q + t0 * n_in, qa.meta + t0 * (n_in / 32)};
      gemv(type, w, n_in, n_out, xd + t0 * n_in, part, nt, od + t0 * n_out, n_out, GemvRoute{},
           stream);
    }
  }
}

void matmul_group(const MatmulJob* jobs, int n_jobs, int64_t n_in, const float* x, int64_t n_tok,
                  void* workspace, size_t workspace_bytes, cudaStream_t stream, bool x_q8,
                  int64_t n_decode, bool invariant) {
  bool all_decode = n_tok > 0 && n_in > 0, any_q = false;
  for (int j = 0; j < n_jobs; ++j) {
    check_type(jobs[j].type, n_in, "matmul_group");
    all_decode =
        all_decode && matmul_decode_rows(jobs[j].type, n_tok, n_decode, "matmul_group") == n_tok;
    any_q = any_q || is_quantized(jobs[j].type);
  }
  if (x_q8 && (!all_decode || n_tok != 1 || n_jobs > 3))
    throw Error(ErrorCategory::invalid_argument,
                "matmul_group: x_q8 serves single-token GEMV groups of at most 3 matrices");
  if (!all_decode || !any_q || (n_jobs < 2 && !x_q8)) {
    for (int j = 0; j < n_jobs; ++j)
      matmul(jobs[j].type, jobs[j].w, n_in, jobs[j].n_out, x, n_tok, jobs[j].out, workspace,
             workspace_bytes, stream, n_decode, invariant);
    return;
  }
  const size_t need = qact_bytes(n_tok, n_in);
  if (workspace_bytes < need || workspace == nullptr)
    throw Error(ErrorCategory::invalid_argument, "matmul_group: workspace of " +
                                                     std::to_string(workspace_bytes) + " bytes, " +
                                                     std::to_string(need) + " needed");
  // Every row a decode row: the activation blocks do not depend on the weight type, so they are
  // quantized once and read by every job.
  const QAct qa = qact_at(workspace, n_tok, n_in);
  if (!x_q8) quantize_act(x, nullptr, n_tok, n_in, qa, stream);
  if (n_tok <= kGemvTok && gemv_group_tokens()) {
    // One launch per weight type and up to 3 matrices (a decode step's Q and K, often V too; a
    // Qwen3.5 GDN layer's ssm_alpha and ssm_beta): the rows of the matrices follow one another
    // in the grid. Matrices share a launch only where each alone would get the same lanes per
    // row (gemv_shape: a K-quant matrix of few rows gets more), so each row keeps its bits.
    std::vector<bool> done(static_cast<size_t>(n_jobs), false);
    for (int j = 0; j < n_jobs; ++j) {
      if (done[static_cast<size_t>(j)]) continue;
      MatmulJob same[3];
      int n = 0;
      for (int k = j; k < n_jobs && n < 3; ++k)
        if (!done[static_cast<size_t>(k)] && jobs[k].type == jobs[j].type && jobs[k].n_out > 0) {
          same[n++] = jobs[k];
          if (!gemv_one_token_lanes_agree(same, n, n_in)) {
            --n;
            continue;
          }
          done[static_cast<size_t>(k)] = true;
        }
      if (n == 0) {
        done[static_cast<size_t>(j)] = true;  // no rows
        continue;
      }
      gemv_one_token(same, n, n_in, qa, x, stream, n_tok);
    }
    return;
  }
  for (int j = 0; j < n_jobs; ++j) {
    const MatmulJob& m = jobs[j];
    for (int64_t t0 = 0; t0 < n_tok && m.n_out > 0; t0 += kGemvTok) {
      const int64_t nt = std::min<int64_t>(kGemvTok, n_tok - t0);
      QAct part{};
      if (is_quantized(m.type)) part = {qa.q + t0 * n_in, qa.meta + t0 * (n_in / 32)};
      gemv(m.type, m.w, n_in, m.n_out, x + t0 * n_in, part, nt, m.out + t0 * m.n_out, m.n_out,
           GemvRoute{}, stream);
    }
  }
}

void swiglu_matmul(GgmlType type, const void* w, int64_t n_in, int64_t n_out, const float* gate,
                   const float* up, float* out, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream) {
  check_type(type, n_in, "swiglu_matmul");
  if (!is_quantized(type))
    throw Error(ErrorCategory::invalid_argument,
                "swiglu_matmul: weight type " + std::string(type_name(type)) +
                    " (quantized weights only: float weights read f32 activations)");
  const size_t need = qact_bytes(1, n_in);
  if (workspace_bytes < need || workspace == nullptr)
    throw Error(ErrorCategory::invalid_argument, "swiglu_matmul: workspace of " +
                                                     std::to_string(workspace_bytes) + " bytes, " +
                                                     std::to_string(need) + " needed");
  if (n_in == 0 || n_out == 0) return;
  // matmul's decode row: quantize_act of the row, then the GEMV of one token.
  const QAct qa = qact_at(workspace, 1, n_in);
  launch("quantize_act_kernel (swiglu)", quantize_act_kernel<true>, blocks_for(n_in, 256), 256, 0,
         stream, gate, up, n_in / 32, qa.q, qa.meta, nullptr, int64_t{0});
  gemv(type, w, n_in, n_out, nullptr, qa, 1, out, n_out, GemvRoute{}, stream);
}

void embed(GgmlType type, const void* w, int64_t n_embd, int64_t n_vocab, const int32_t* tokens,
           int64_t n_tok, float* out, cudaStream_t stream) {
  check_type(type, n_embd, "embed");
  if (n_tok <= 0 || n_embd == 0) return;
  dequant_rows(type, w, n_embd, n_vocab, tokens, 0, n_tok, out, false, stream);
}

}  // namespace berth::gpu
