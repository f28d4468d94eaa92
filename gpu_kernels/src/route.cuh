// The MoE router's selection (moe_route, and the fused router + route in matmul.cu): one warp
// per token, replaying berth::cpu::moe_topk's arithmetic.
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <string>

#include "berth/core/error.h"

namespace berth::gpu {
namespace {

// One warp per token, replaying berth::cpu::moe_topk's arithmetic: keys are the logits in
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

// ex[e] = exp(key(l[e]) - max key) for every expert, by the warp's lanes (the general path's
// softmax numerators; the fast path computes the same values from its registers).
__device__ __forceinline__ void route_exp(const float* l, int32_t n_expert, int lane, double* ex) {
  float mx = -CUDART_INF_F;
  for (int32_t e = lane; e < n_expert; e += 32) mx = fmaxf(mx, route_key(l[e]));
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const double mxd = mx;
  for (int32_t e = lane; e < n_expert; e += 32)
    ex[e] = exp(static_cast<double>(route_key(l[e])) - mxd);
}

// The route of one token by one warp (lane = threadIdx.x % 32): l [n_expert] logits, o [2k]
// (ids as exact floats, then weights), ex: n_expert doubles of scratch (shared memory). Every
// lane of the warp must call it. `forced` (null: the router selects): the token's k experts,
// given (a routing trace replayed); their weights are computed as for selected ones.
__device__ __forceinline__ void route_one_token(const float* l, int32_t n_expert, int32_t k,
                                                bool norm, float* o, double* ex,
                                                const int32_t* forced = nullptr) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  constexpr unsigned kAll = 0xffffffffu;
  int32_t my_id = -1;  // lane j: slot j's expert

  if (forced != nullptr) {
    route_exp(l, n_expert, lane, ex);
    if (lane < k) {
      my_id = forced[lane];
      o[lane] = static_cast<float>(my_id);
    }
  } else if (n_expert <= 32 * kRoutePer) {
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
    route_exp(l, n_expert, lane, ex);

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
}

// Host side: the arguments every router launch checks (Error(invalid_argument)).
inline void check_route(int32_t n_expert, int32_t k) {
  const auto bad = [](const std::string& what) {
    throw Error(ErrorCategory::invalid_argument, what);
  };
  if (k < 1 || k > n_expert)
    bad("gpu::moe_route: k = " + std::to_string(k) +
        " must be in [1, n_expert = " + std::to_string(n_expert) + "]");
  if (static_cast<size_t>(n_expert) * sizeof(double) > 48 * 1024)
    bad("gpu::moe_route: n_expert = " + std::to_string(n_expert) + " exceeds 6144");
  if (k > 32) bad("gpu::moe_route: n_expert_used = " + std::to_string(k) + " exceeds 32");
}

}  // namespace
}  // namespace berth::gpu
