// Selection kernels: the MoE router (moe_route), greedy argmax and top-k of a logits row.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "handoff.cuh"
#include "launch.cuh"

namespace berth::gpu {
namespace {

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

// ---- moe_route -------------------------------------------------------------------------------
// One block per token, replaying berth::cpu::moe_topk's arithmetic: keys are the logits in
// double (NaN -> -inf); the k best by (key descending, id ascending), a strict total order, so
// the parallel selection below picks exactly the serial one's ids; max (order-free), each
// exp(key - max) computed once by its thread, then the softmax denominator summed by one thread
// sequentially over e = 0..n-1 and the selected sum in slot order, then p or p / sel rounded once
// to float: the same operations on the same values as the host. The only possible difference
// from the host is the last bit of a double exp (both libraries are within 1 ulp), which the
// final rounding to float absorbs except in vanishingly rare cases.
constexpr int kRouteThreads = 32;  // one warp per token: no block-wide barrier per slot

// Selection keys in float: a logit's conversion to double is exact, so comparing floats orders
// exactly as comparing the host's double keys.
__device__ __forceinline__ float route_key(float l) { return isnan(l) ? -CUDART_INF_F : l; }

// (key, id) ahead of (bkey, bid) in the selection order; id < 0 is "none".
__device__ __forceinline__ bool route_ahead(float key, int32_t id, float bkey, int32_t bid) {
  return bid < 0 || (id >= 0 && (key > bkey || (key == bkey && id < bid)));
}

// The best of this lane's experts (lane, lane + 32, ...) behind (pk, pi) in the selection order
// (pi < 0: the best of all). A lane's chosen experts are always a prefix of its own order, so
// "behind the last one taken" is "not taken yet".
__device__ __forceinline__ void lane_next(const float* l, int32_t n_expert, int lane, float pk,
                                          int32_t pi, float& bk, int32_t& bi) {
  bk = 0.0f;
  bi = -1;
  for (int32_t e = lane; e < n_expert; e += 32) {
    const float key = route_key(l[e]);
    if (pi >= 0 && !route_ahead(pk, pi, key, e)) continue;
    if (route_ahead(key, e, bk, bi)) bk = key, bi = e;
  }
}

// Order-preserving map of a key to an unsigned integer (larger key, larger integer). Keys are
// never NaN, and -0 was made +0 by route_key_z, so equal keys map to equal integers.
__device__ __forceinline__ uint32_t key_bits(float key) {
  const uint32_t u = __float_as_uint(key);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_key_z(float l) {
  const float k = route_key(l);
  return k == 0.0f ? 0.0f : k;  // -0 == +0 as keys: one integer for both
}

// Experts per lane kept in registers by the fast path (n_expert <= 32 * kRoutePer).
constexpr int kRoutePer = 8;

// kSignal (moe_route_signal, one token): then the block copies `cp` to the host and releases
// *flag, as copy_out_signal does.
template <bool kSignal>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const float* logits, int32_t n_expert, int32_t k, bool norm, float* out,
                     Copies cp, uint32_t* flag, uint32_t value) {
  pdl_enter();
  extern __shared__ double ex[];  // n_expert: exp(key - max)
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * n_expert;
  float* o = out + static_cast<int64_t>(blockIdx.x) * 2 * k;
  const int lane = static_cast<int>(threadIdx.x);
  constexpr unsigned kAll = 0xffffffffu;
  int32_t my_id = -1;  // lane j: slot j's expert

  if (n_expert <= 32 * kRoutePer) {
    // Fast path: lane's experts lane + 32u in registers, loaded together; each slot is the
    // largest key (one redux) and, among lanes holding it, the lowest id (another redux).
    float key[kRoutePer];
    uint32_t bits[kRoutePer];
#pragma unroll
    for (int u = 0; u < kRoutePer; ++u) {
      const int32_t e = lane + 32 * u;
      key[u] = e < n_expert ? route_key_z(l[e]) : -CUDART_INF_F;
      bits[u] = e < n_expert ? key_bits(key[u]) : 0u;  // 0: below every real key
    }
    uint32_t mb = 0;
#pragma unroll
    for (int u = 0; u < kRoutePer; ++u) mb = max(mb, bits[u]);
    mb = __reduce_max_sync(kAll, mb);
    const float mx = __uint_as_float((mb & 0x80000000u) ? (mb & 0x7fffffffu) : ~mb);
    const double mxd = mx;
#pragma unroll
    for (int u = 0; u < kRoutePer; ++u) {
      const int32_t e = lane + 32 * u;
      if (e < n_expert) ex[e] = exp(static_cast<double>(key[u]) - mxd);
    }
    // This lane's head: its best expert not chosen yet (highest bits, then lowest u).
    uint32_t taken = 0;
    const auto head = [&](uint32_t& hb, int32_t& hid) {
      hb = 0;
      hid = 0x7fffffff;
#pragma unroll
      for (int u = 0; u < kRoutePer; ++u)
        if (!(taken >> u & 1u) && lane + 32 * u < n_expert && (hid == 0x7fffffff || bits[u] > hb))
          hb = bits[u], hid = lane + 32 * u;
    };
    uint32_t hb;
    int32_t hid;
    head(hb, hid);
    for (int32_t j = 0; j < k; ++j) {
      const uint32_t best = __reduce_max_sync(kAll, hb);
      const int32_t id = static_cast<int32_t>(
          __reduce_min_sync(kAll, hb == best ? static_cast<uint32_t>(hid) : 0x7fffffffu));
      if (lane == 0) o[j] = static_cast<float>(id);
      if (lane == j) my_id = id;
      if (hid == id) {
        taken |= 1u << ((id - lane) / 32);
        head(hb, hid);
      }
    }
  } else {
    float mx = -CUDART_INF_F;
    for (int32_t e = lane; e < n_expert; e += 32) mx = fmaxf(mx, route_key(l[e]));
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(kAll, mx, off));
    const double mxd = mx;
    for (int32_t e = lane; e < n_expert; e += 32)
      ex[e] = exp(static_cast<double>(route_key(l[e])) - mxd);

    // Slot j: the warp-wide best of the lanes' heads (each lane's best expert not yet chosen);
    // the lane that owned the winner moves its head on.
    float hk;
    int32_t hi;
    lane_next(l, n_expert, lane, 0.0f, -1, hk, hi);
    for (int32_t j = 0; j < k; ++j) {
      float bkey = hk;
      int32_t bid = hi;
      for (int off = 16; off > 0; off >>= 1) {
        const float ok = __shfl_xor_sync(kAll, bkey, off);
        const int32_t oi = __shfl_xor_sync(kAll, bid, off);
        if (route_ahead(ok, oi, bkey, bid)) bkey = ok, bid = oi;
      }
      // Every lane holds the same winner now.
      if (lane == 0) o[j] = static_cast<float>(bid);
      if (lane == j) my_id = bid;
      if (hi == bid) lane_next(l, n_expert, lane, hk, hi, hk, hi);
    }
  }
  __syncwarp();
  // The denominator sequentially over e = 0..n-1 (the host's order), by lane 0.
  double sum = 0.0;
  if (lane == 0)
    for (int32_t e = 0; e < n_expert; ++e) sum += ex[e];
  sum = __shfl_sync(kAll, sum, 0);
  // p_j by lane j in parallel (same division as the host); sel = sum of p_j in slot order.
  const double p = lane < k ? ex[my_id] / sum : 0.0;
  double sel = 0.0;
  for (int32_t j = 0; j < k; ++j) sel += __shfl_sync(kAll, p, j);
  if (lane < k) o[k + lane] = static_cast<float>(norm ? p / sel : p);
  if constexpr (kSignal) {
    __syncthreads();  // the route's stores above are visible to the block's copies
    copy_out_and_signal(cp, flag, value);
  }
}

// ---- argmax ----------------------------------------------------------------------------------
constexpr int kArgmaxThreads = 512;

// (v, i) better than (bv, bi): larger value, or equal value and lower id. NaN counts as -inf.
__device__ __forceinline__ bool better(float v, int32_t i, float bv, int32_t bi) {
  return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_kernel(const float* logits, int64_t n_vocab, int32_t* ids) {
  pdl_enter();
  const float* l = logits + static_cast<int64_t>(blockIdx.x) * n_vocab;
  float bv = -CUDART_INF_F;
  int32_t bi = 0x7fffffff;
  for (int64_t i = threadIdx.x; i < n_vocab; i += blockDim.x) {
    float v = l[i];
    if (isnan(v)) v = -CUDART_INF_F;
    if (better(v, static_cast<int32_t>(i), bv, bi)) {
      bv = v;
      bi = static_cast<int32_t>(i);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) {
      bv = ov;
      bi = oi;
    }
  }
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int32_t si[kArgmaxThreads / 32];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / 32; ++w)
      if (better(sv[w], si[w], bv, bi)) {
        bv = sv[w];
        bi = si[w];
      }
    ids[blockIdx.x] = bi < n_vocab ? bi : 0;
  }
}

// ---- top_k -----------------------------------------------------------------------------------
// Rounds of chunked selection: each block bitonic-sorts a chunk of kChunk candidates in shared
// memory and keeps its k best; rounds repeat on the survivors until one chunk is left. A
// candidate is one 64-bit key, (order-preserving bits of the value) << 32 | ~id, so one unsigned
// comparison orders by value descending, then id ascending. NaN maps below every number, -0 to
// +0 (they compare equal as floats), padding is key 0 (below everything real).
constexpr int kChunk = 4096;
constexpr int kTopkThreads = 1024;

__device__ __forceinline__ uint64_t topk_key(float v, uint32_t id) {
  uint32_t ord;
  if (isnan(v)) {
    ord = 0;
  } else {
    if (v == 0.0f) v = 0.0f;
    const uint32_t b = __float_as_uint(v);
    ord = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  }
  return (static_cast<uint64_t>(ord) << 32) | static_cast<uint64_t>(~id);
}

__global__ void __launch_bounds__(kTopkThreads)
    topk_round_kernel(const float* logits, const uint64_t* in_keys, int64_t n_in, int32_t k,
                      uint64_t* out_keys, int32_t* ids, float* values) {
  pdl_enter();
  __shared__ uint64_t s[kChunk];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kChunk;
  for (int i = threadIdx.x; i < kChunk; i += blockDim.x) {
    const int64_t g = base + i;
    uint64_t key = 0;
    if (g < n_in) key = in_keys ? in_keys[g] : topk_key(logits[g], static_cast<uint32_t>(g));
    s[i] = key;
  }
  __syncthreads();
  // Bitonic sort, descending overall.
  for (int size = 2; size <= kChunk; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < kChunk / 2; i += blockDim.x) {
        const int pos = 2 * i - (i & (stride - 1));
        const int partner = pos + stride;
        const bool desc = (pos & size) == 0;
        const uint64_t a = s[pos], b = s[partner];
        if (desc ? a < b : a > b) {
          s[pos] = b;
          s[partner] = a;
        }
      }
      __syncthreads();
    }
  }
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const uint64_t key = s[j];
    if (ids) {
      const uint32_t id = ~static_cast<uint32_t>(key & 0xffffffffu);
      ids[j] = static_cast<int32_t>(id);
      values[j] = logits[id];
    } else {
      out_keys[static_cast<int64_t>(blockIdx.x) * k + j] = key;
    }
  }
}

int64_t chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

void check_route(int32_t n_expert, int32_t k) {
  if (k < 1 || k > n_expert)
    bad_arg("gpu::moe_route: k = " + std::to_string(k) +
            " must be in [1, n_expert = " + std::to_string(n_expert) + "]");
  if (static_cast<size_t>(n_expert) * sizeof(double) > 48 * 1024)
    bad_arg("gpu::moe_route: n_expert = " + std::to_string(n_expert) + " exceeds 6144");
  if (k > 32) bad_arg("gpu::moe_route: n_expert_used = " + std::to_string(k) + " exceeds 32");
}

}  // namespace

void moe_route(const float* logits, int64_t n_tok, int32_t n_expert, int32_t k, bool norm,
               float* out, cudaStream_t stream) {
  check_route(n_expert, k);
  if (n_tok <= 0) return;
  if (n_tok > 0x7fffffff) bad_arg("gpu::moe_route: too many tokens");
  const size_t smem = static_cast<size_t>(n_expert) * sizeof(double);
  launch("moe_route_kernel", moe_route_kernel<false>, static_cast<unsigned>(n_tok), kRouteThreads,
         smem, stream, logits, n_expert, k, norm, out, Copies{}, nullptr, 0u);
}

void moe_route_signal(const float* logits, int32_t n_expert, int32_t k, bool norm, float* out,
                      const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                      cudaStream_t stream) {
  check_route(n_expert, k);
  const Copies cp = pack_copies(copies, n, "gpu::moe_route_signal");
  launch("moe_route_kernel (signal)", moe_route_kernel<true>, 1, kRouteThreads,
         static_cast<size_t>(n_expert) * sizeof(double), stream, logits, n_expert, k, norm, out, cp,
         flag, value);
}

void argmax(const float* logits, int64_t rows, int64_t n_vocab, int32_t* ids, cudaStream_t stream) {
  if (n_vocab <= 0 || n_vocab > 0x7fffffff) bad_arg("gpu::argmax: bad n_vocab");
  if (rows <= 0) return;
  launch("argmax_kernel", argmax_kernel, static_cast<unsigned>(rows), kArgmaxThreads, 0, stream,
         logits, n_vocab, ids);
}

size_t top_k_workspace_bytes(int64_t n_vocab, int32_t k) {
  if (n_vocab <= kChunk) return 0;
  // Ping-pong buffers of the first round's survivors (later rounds have fewer).
  return static_cast<size_t>(2 * chunks(n_vocab) * k) * sizeof(uint64_t);
}

void top_k(const float* logits, int64_t n_vocab, int32_t k, int32_t* ids, float* values,
           void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (k < 1 || k > 256 || k > n_vocab)
    bad_arg("gpu::top_k: k = " + std::to_string(k) +
            " must be in [1, min(256, n_vocab = " + std::to_string(n_vocab) + ")]");
  if (n_vocab > 0x7fffffff) bad_arg("gpu::top_k: n_vocab too large");
  if (workspace_bytes < top_k_workspace_bytes(n_vocab, k))
    bad_arg("gpu::top_k: workspace of " + std::to_string(workspace_bytes) + " bytes, needs " +
            std::to_string(top_k_workspace_bytes(n_vocab, k)));
  uint64_t* buf[2] = {static_cast<uint64_t*>(workspace), nullptr};
  if (n_vocab > kChunk) buf[1] = buf[0] + chunks(n_vocab) * k;
  const uint64_t* in = nullptr;
  int64_t n = n_vocab;
  int which = 0;
  for (;;) {
    const int64_t c = chunks(n);
    const bool last = c == 1;
    launch("topk_round_kernel", topk_round_kernel, static_cast<unsigned>(c), kTopkThreads, 0,
           stream, logits, in, n, k, last ? nullptr : buf[which], last ? ids : nullptr,
           last ? values : nullptr);
    if (last) break;
    in = buf[which];
    n = c * k;
    which ^= 1;
  }
}

}  // namespace berth::gpu
