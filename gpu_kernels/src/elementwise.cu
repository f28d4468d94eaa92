// Element-wise and per-row kernels of the step graph: rms_norm, add, add_bias, swiglu, rope.
// Each mirrors the CPU reference (cpu_kernels/src/ops.cpp, runtime/src/cpu_backend.cpp) in its
// formula and, where cheap, in its precision (sums of squares and RoPE angles in double).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"
#include "handoff.cuh"
#include "launch.cuh"

namespace berth::gpu {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements (launch.cuh).
unsigned grid_for(int64_t n) { return grid_stride_blocks(n, kThreads); }

// Values a thread of a whole-row norm keeps in registers (rows of up to kPer x 256 = 8192 values
// are read once, all loads in flight together; longer rows stream through the loops, about one
// load latency per value each). The sums of squares are the same either way.
constexpr int kPer = 32;

// The block's sum of squares of the values v[u] = x[threadIdx.x + u * blockDim.x] (each thread
// adds its own in that order, in double as the CPU kernels do), then the RMS scale
// 1 / sqrt(mean + eps) rounded to float, returned to every thread. Every kernel that normalises
// uses this one reduction, with the thread count rms_threads() picks, so fused kernels give the
// same bits as rms_norm.
__device__ __forceinline__ float block_rms_scale(double ss, int64_t group, float eps) {
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  __shared__ double part[kThreads / 32];
  __shared__ float scale_s;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int i = 0; i < static_cast<int>(blockDim.x + 31) / 32; ++i) t += part[i];
    scale_s = static_cast<float>(1.0 / sqrt(t / static_cast<double>(group) + eps));
  }
  __syncthreads();
  return scale_s;
}
__device__ __forceinline__ float block_rms_scale(const float* xr, int64_t group, float eps) {
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
    const double v = xr[i];
    ss += v * v;
  }
  return block_rms_scale(ss, group, eps);
}

// Threads per block for runs of `group` values: small groups (per-head norms) get a warp or
// two, whole rows a full block.
int rms_threads(int64_t group) {
  int threads = kThreads;
  while (threads > 32 && threads / 2 >= group) threads /= 2;
  return threads;
}

// One block per run of `group` values. With `b` (add_rms_norm): the normalised values are
// those of x + b, which are also written to `sum`. Runs of up to kPer values per thread are
// loaded into registers first (one memory latency instead of one per value: the outputs may
// alias the inputs, so a plain loop would wait for each load); longer runs take the loops.
// kHostB (wait_add_rms_norm): b is in host memory, written by a host thread that then releases
// *flag; the block's first thread acquires the flag (system scope), the block meets at a
// barrier, and b is read with ld.cv (never from a line cached before the flag).
template <bool kHostB>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const float* x, const float* w, float* out, int64_t group, float eps,
                    const float* b, float* sum, const uint32_t* flag, uint32_t value) {
  pdl_enter();
  if constexpr (kHostB) wait_host_flag(flag, value);
  const auto bv = [&](int64_t i) { return kHostB ? __ldcv(b + i) : b[i]; };
  const int64_t base = static_cast<int64_t>(blockIdx.x) * group;
  const float* xr = x + base;
  float* yr = out + base;
  const int t = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  if (group <= static_cast<int64_t>(kPer) * nt) {
    float v[kPer], wv[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t i = t + static_cast<int64_t>(u) * nt;
      v[u] = i < group ? (b ? xr[i] + bv(base + i) : xr[i]) : 0.0f;
      wv[u] = i < group && w ? w[i] : 1.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const double d = v[u];
      ss += d * d;  // zeros past the run add nothing: the same sum as the loop
    }
    if (b) {
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        const int64_t i = t + static_cast<int64_t>(u) * nt;
        if (i < group) sum[base + i] = v[u];
      }
    }
    const float scale = block_rms_scale(ss, group, eps);
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int64_t i = t + static_cast<int64_t>(u) * nt;
      if (i < group) yr[i] = w ? v[u] * scale * wv[u] : v[u] * scale;
    }
    return;
  }
  if (b) {
    float* sr = sum + base;
    for (int64_t i = t; i < group; i += nt) sr[i] = xr[i] + bv(base + i);
    xr = sr;
  }
  const float scale = block_rms_scale(xr, group, eps);
  for (int64_t i = t; i < group; i += nt) yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void add_bias_kernel(const float* x, const float* bias, float* out, int64_t n,
                                int64_t cols) {
  pdl_enter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = x[i] + bias[i % cols];
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// RoPE's cos and sin for pair slot s of a row at `pos`: the angle in double, rounded to float
// as the CPU backend's table: theta_s = pos * base^(-2s/n_rot).
__device__ __forceinline__ void rope_cs(int32_t pos, int32_t s, int32_t n_rot, double freq_base,
                                        float& c, float& si) {
  const double theta = static_cast<double>(pos) * pow(freq_base, -2.0 * s / n_rot);
  double sn, cs;
  sincos(theta, &sn, &cs);
  c = static_cast<float>(cs);
  si = static_cast<float>(sn);
}
// The rotation of (a, b), each product rounded (no FMA contraction), as the CPU computes it.
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float si, float& o0,
                                            float& o1) {
  o0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, si));
  o1 = __fadd_rn(__fmul_rn(a, si), __fmul_rn(b, c));
}

// One thread per (row, head, slot): slots [0, n_rot/2) rotate a pair; slots past that copy one
// of the dims >= n_rot (a no-op when out == x).
__global__ void rope_kernel(const float* x, float* out, int64_t rows, int32_t n_head,
                            int32_t head_dim, int32_t n_rot, double freq_base, bool neox,
                            const int32_t* positions) {
  pdl_enter();
  const int32_t half = n_rot / 2;
  const int32_t slots = half + (head_dim - n_rot);
  const int64_t n = rows * n_head * slots;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int32_t s = static_cast<int32_t>(idx % slots);
    const int64_t rh = idx / slots;  // row * n_head + head
    const int64_t r = rh / n_head;
    const int64_t off = rh * head_dim;
    if (s < half) {
      float c, si;
      rope_cs(positions[r], s, n_rot, freq_base, c, si);
      const int32_t i0 = neox ? s : 2 * s;
      const int32_t i1 = neox ? s + half : 2 * s + 1;
      rope_rotate(x[off + i0], x[off + i1], c, si, out[off + i0], out[off + i1]);
    } else {
      const int64_t d = off + n_rot + (s - half);
      out[d] = x[d];
    }
  }
}

struct NormRopeJobs {
  NormRopeJob j[2];
  int n;
};

// One block per (row, head) of the jobs' heads, row-major, job 0's heads before job 1's: the
// head's RMS scale (block_rms_scale, as rms_norm_kernel), then each slot as rope_kernel does
// on the normalised values (x * scale * w rounded to float, the value rms_norm stores).
__global__ void __launch_bounds__(kThreads)
    norm_rope_kernel(NormRopeJobs jobs, int32_t head_dim, float eps, int32_t n_rot,
                     double freq_base, bool neox, const int32_t* positions) {
  pdl_enter();
  const int32_t heads = jobs.j[0].n_head + (jobs.n > 1 ? jobs.j[1].n_head : 0);
  const int64_t r = blockIdx.x / heads;
  int32_t h = static_cast<int32_t>(blockIdx.x % heads);
  int ji = 0;
  if (h >= jobs.j[0].n_head) h -= jobs.j[0].n_head, ji = 1;
  const NormRopeJob& jb = jobs.j[ji];
  const int64_t off = (r * jb.n_head + h) * head_dim;
  const float* xr = jb.x + off;
  const float* w = jb.w;
  const float scale = block_rms_scale(xr, head_dim, eps);
  const auto norm = [&](int32_t i) { return w ? xr[i] * scale * w[i] : xr[i] * scale; };
  const int32_t half = n_rot / 2;
  const int32_t slots = half + (head_dim - n_rot);
  float* yr = jb.out + off;
  // All reads of this head happen before the barrier's other side; out may equal x, and each
  // slot's outputs are written only after both its inputs are read.
  float y0[2], y1[2];
  int32_t d0[2], d1[2];
  int cnt = 0;
  for (int32_t s = threadIdx.x; s < slots; s += blockDim.x, ++cnt) {
    if (s < half) {
      float c, si;
      rope_cs(positions[r], s, n_rot, freq_base, c, si);
      d0[cnt] = neox ? s : 2 * s;
      d1[cnt] = neox ? s + half : 2 * s + 1;
      rope_rotate(norm(d0[cnt]), norm(d1[cnt]), c, si, y0[cnt], y1[cnt]);
    } else {
      d0[cnt] = n_rot + (s - half);
      d1[cnt] = -1;
      y0[cnt] = norm(d0[cnt]);
    }
  }
  __syncthreads();
  for (int i = 0; i < cnt; ++i) {
    yr[d0[i]] = y0[i];
    if (d1[i] >= 0) yr[d1[i]] = y1[i];
  }
}

void bad_arg(const std::string& what) { throw Error(ErrorCategory::invalid_argument, what); }

}  // namespace

void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t cols, int64_t group,
              float eps, cudaStream_t stream) {
  if (group <= 0 || cols % group != 0)
    bad_arg("gpu::rms_norm: group " + std::to_string(group) + " does not divide cols " +
            std::to_string(cols));
  const int64_t runs = rows * (cols / group);
  if (runs == 0) return;
  if (runs > 0x7fffffff) bad_arg("gpu::rms_norm: too many rows");
  launch("rms_norm_kernel", rms_norm_kernel<false>, static_cast<unsigned>(runs), rms_threads(group),
         0, stream, x, w, out, group, eps, nullptr, nullptr, nullptr, 0u);
}

void add_rms_norm(const float* a, const float* b, float* sum, const float* w, float* out,
                  int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > 0x7fffffff) bad_arg("gpu::add_rms_norm: too many rows");
  // The thread count rms_norm picks for whole rows, so the sums of squares add up in the same
  // order and the outputs equal add() then rms_norm() bit for bit.
  launch("rms_norm_kernel (add)", rms_norm_kernel<false>, static_cast<unsigned>(rows),
         rms_threads(cols), 0, stream, a, w, out, cols, eps, b, sum, nullptr, 0u);
}

void wait_add_rms_norm(const uint32_t* flag, uint32_t value, const float* a, const float* b_host,
                       float* sum, const float* w, float* out, int64_t rows, int64_t cols,
                       float eps, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > 0x7fffffff) bad_arg("gpu::wait_add_rms_norm: too many rows");
  // The thread count add_rms_norm picks: the same sums in the same order, the same bits.
  launch("rms_norm_kernel (wait, add)", rms_norm_kernel<true>, static_cast<unsigned>(rows),
         rms_threads(cols), 0, stream, a, w, out, cols, eps, b_host, sum, flag, value);
}

void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch("add_kernel", add_kernel, grid_for(n), kThreads, 0, stream, a, b, out, n);
}

void add_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols,
              cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  launch("add_bias_kernel", add_bias_kernel, grid_for(n), kThreads, 0, stream, x, bias, out, n,
         cols);
}

void swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  launch("swiglu_kernel", swiglu_kernel, grid_for(n), kThreads, 0, stream, gate, up, out, n);
}

void rope(const float* x, float* out, int64_t rows, int32_t n_head, int32_t head_dim, int32_t n_rot,
          float freq_base, bool neox, const int32_t* positions, cudaStream_t stream) {
  if (n_rot < 0 || n_rot % 2 != 0 || n_rot > head_dim || n_head <= 0)
    bad_arg("gpu::rope: n_rot " + std::to_string(n_rot) + " must be even and <= head_dim " +
            std::to_string(head_dim));
  const int64_t n = rows * n_head * (n_rot / 2 + (head_dim - n_rot));
  if (n <= 0) return;
  launch("rope_kernel", rope_kernel, grid_for(n), kThreads, 0, stream, x, out, rows, n_head,
         head_dim, n_rot, static_cast<double>(freq_base), neox, positions);
}

void norm_rope(const NormRopeJob* jobs, int n_jobs, int64_t rows, int32_t head_dim, float eps,
               int32_t n_rot, float freq_base, bool neox, const int32_t* positions,
               cudaStream_t stream) {
  if (n_jobs < 1 || n_jobs > 2)
    bad_arg("gpu::norm_rope: " + std::to_string(n_jobs) + " jobs (1 or 2)");
  if (n_rot < 0 || n_rot % 2 != 0 || n_rot > head_dim || head_dim <= 0)
    bad_arg("gpu::norm_rope: n_rot " + std::to_string(n_rot) + " must be even and <= head_dim " +
            std::to_string(head_dim));
  const int threads = rms_threads(head_dim);
  // Each thread keeps at most two slots in registers (slots <= head_dim <= 2 * threads).
  if (head_dim > 2 * threads)
    bad_arg("gpu::norm_rope: head_dim " + std::to_string(head_dim) + " exceeds " +
            std::to_string(2 * kThreads));
  NormRopeJobs j{};
  int64_t heads = 0;
  for (int i = 0; i < n_jobs; ++i) {
    if (jobs[i].n_head <= 0) bad_arg("gpu::norm_rope: a job has no heads");
    j.j[i] = jobs[i];
    heads += jobs[i].n_head;
  }
  j.n = n_jobs;
  if (rows <= 0) return;
  if (rows * heads > 0x7fffffff) bad_arg("gpu::norm_rope: too many rows");
  launch("norm_rope_kernel", norm_rope_kernel, static_cast<unsigned>(rows * heads), threads, 0,
         stream, j, head_dim, eps, n_rot, static_cast<double>(freq_base), neox, positions);
}

}  // namespace berth::gpu
