// Element-wise and per-row kernels of the step graph: rms_norm, add, add_bias, swiglu, rope.
// Each mirrors the CPU reference (cpu_kernels/src/ops.cpp, runtime/src/cpu_backend.cpp) in its
// formula and, where cheap, in its precision (sums of squares and RoPE angles in double).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "berth/gpu_kernels/kernels.h"
#include "check.cuh"

namespace berth::gpu {
namespace {

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements (capped: the loops stride over the rest).
unsigned grid_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

// One block per run of `group` values. The sum of squares accumulates in double (as the CPU
// kernels do), so the float scale matches the reference's to within one rounding.
// With `b` (add_rms_norm): the normalised values are those of x + b, which are also written to
// `sum`; each thread reads back only the sums it wrote.
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const float* x, const float* w, float* out, int64_t group, float eps,
                    const float* b = nullptr, float* sum = nullptr) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * group;
  const float* xr = x + base;
  if (b) {
    const float* br = b + base;
    float* sr = sum + base;
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) sr[i] = xr[i] + br[i];
    xr = sr;
  }
  double ss = 0.0;
  for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
    const double v = xr[i];
    ss += v * v;
  }
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
  const float scale = scale_s;
  float* yr = out + base;
  for (int64_t i = threadIdx.x; i < group; i += blockDim.x)
    yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

__global__ void add_kernel(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void add_bias_kernel(const float* x, const float* bias, float* out, int64_t n,
                                int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = x[i] + bias[i % cols];
}

__global__ void swiglu_kernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// One thread per (row, head, slot): slots [0, n_rot/2) rotate a pair; slots past that copy one
// of the dims >= n_rot (a no-op when out == x). The angle is computed in double and rounded to
// float as the CPU backend's table: theta_i = pos * base^(-2i/n_rot).
__global__ void rope_kernel(const float* x, float* out, int64_t rows, int32_t n_head,
                            int32_t head_dim, int32_t n_rot, double freq_base, bool neox,
                            const int32_t* positions) {
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
      const double theta = static_cast<double>(positions[r]) * pow(freq_base, -2.0 * s / n_rot);
      double sn, cs;
      sincos(theta, &sn, &cs);
      const float c = static_cast<float>(cs), si = static_cast<float>(sn);
      const int32_t i0 = neox ? s : 2 * s;
      const int32_t i1 = neox ? s + half : 2 * s + 1;
      const float a = x[off + i0], b = x[off + i1];
      out[off + i0] = a * c - b * si;
      out[off + i1] = a * si + b * c;
    } else {
      const int64_t d = off + n_rot + (s - half);
      out[d] = x[d];
    }
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
  // Small groups (per-head norms) get a warp or two, whole rows a full block.
  int threads = kThreads;
  while (threads > 32 && threads / 2 >= group) threads /= 2;
  rms_norm_kernel<<<static_cast<unsigned>(runs), threads, 0, stream>>>(x, w, out, group, eps);
  BERTH_LAUNCH_CHECK("rms_norm_kernel");
}

void add_rms_norm(const float* a, const float* b, float* sum, const float* w, float* out,
                  int64_t rows, int64_t cols, float eps, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  if (rows > 0x7fffffff) bad_arg("gpu::add_rms_norm: too many rows");
  // The thread count rms_norm picks for whole rows, so the sums of squares add up in the same
  // order and the outputs equal add() then rms_norm() bit for bit.
  int threads = kThreads;
  while (threads > 32 && threads / 2 >= cols) threads /= 2;
  rms_norm_kernel<<<static_cast<unsigned>(rows), threads, 0, stream>>>(a, w, out, cols, eps, b,
                                                                       sum);
  BERTH_LAUNCH_CHECK("rms_norm_kernel (add)");
}

void add(const float* a, const float* b, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(a, b, out, n);
  BERTH_LAUNCH_CHECK("add_kernel");
}

void add_bias(const float* x, const float* bias, float* out, int64_t rows, int64_t cols,
              cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return;
  add_bias_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, bias, out, n, cols);
  BERTH_LAUNCH_CHECK("add_bias_kernel");
}

void swiglu(const float* gate, const float* up, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  swiglu_kernel<<<grid_for(n), kThreads, 0, stream>>>(gate, up, out, n);
  BERTH_LAUNCH_CHECK("swiglu_kernel");
}

void rope(const float* x, float* out, int64_t rows, int32_t n_head, int32_t head_dim, int32_t n_rot,
          float freq_base, bool neox, const int32_t* positions, cudaStream_t stream) {
  if (n_rot < 0 || n_rot % 2 != 0 || n_rot > head_dim || n_head <= 0)
    bad_arg("gpu::rope: n_rot " + std::to_string(n_rot) + " must be even and <= head_dim " +
            std::to_string(head_dim));
  const int64_t n = rows * n_head * (n_rot / 2 + (head_dim - n_rot));
  if (n <= 0) return;
  rope_kernel<<<grid_for(n), kThreads, 0, stream>>>(
      x, out, rows, n_head, head_dim, n_rot, static_cast<double>(freq_base), neox, positions);
  BERTH_LAUNCH_CHECK("rope_kernel");
}

}  // namespace berth::gpu
