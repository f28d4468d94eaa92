// Selection kernels: the MoE router (moe_route), greedy argmax and top-k of a logits row.
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "handoff.cuh"
#include "launch.cuh"
#include "route.cuh"

namespace berth::gpu {
namespace {

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

// ---- moe_route (route.cuh) -------------------------------------------------------------------

// kSignal (moe_route_signal, one token): then the block copies `cp` to the host and releases
// *flag, as copy_out_signal does.
template <bool kSignal>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const float* logits, int32_t n_expert, int32_t k, bool norm, float* out,
                     Copies cp, uint32_t* flag, uint32_t value, const int32_t* forced) {
  pdl_enter();
  extern __shared__ double ex[];  // n_expert: exp(key - max)
  route_one_token(logits + static_cast<int64_t>(blockIdx.x) * n_expert, n_expert, k, norm,
                  out + static_cast<int64_t>(blockIdx.x) * 2 * k, ex,
                  forced ? forced + static_cast<int64_t>(blockIdx.x) * k : nullptr);
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

}  // namespace

void moe_route(const float* logits, int64_t n_tok, int32_t n_expert, int32_t k, bool norm,
               float* out, cudaStream_t stream, const int32_t* forced) {
  check_route(n_expert, k);
  if (n_tok <= 0) return;
  if (n_tok > 0x7fffffff) bad_arg("gpu::moe_route: too many tokens");
  const size_t smem = static_cast<size_t>(n_expert) * sizeof(double);
  launch("moe_route_kernel", moe_route_kernel<false>, static_cast<unsigned>(n_tok), kRouteThreads,
         smem, stream, logits, n_expert, k, norm, out, Copies{}, nullptr, 0u, forced);
}

void moe_route_signal(const float* logits, int32_t n_expert, int32_t k, bool norm, float* out,
                      const HostCopy* copies, int n, uint32_t* flag, uint32_t value,
                      cudaStream_t stream, const int32_t* forced) {
  check_route(n_expert, k);
  const Copies cp = pack_copies(copies, n, "gpu::moe_route_signal");
  launch("moe_route_kernel (signal)", moe_route_kernel<true>, 1, kRouteThreads,
         static_cast<size_t>(n_expert) * sizeof(double), stream, logits, n_expert, k, norm, out, cp,
         flag, value, forced);
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
