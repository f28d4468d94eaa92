// Diagnostic (device): rms_norm of one 5120-value row (Qwen3.5-27B), a copy of berth's kernel and
// variants (threads, float or double sums, with or without the residual), each 200 times in a
// CUDA graph of PDL launches as a decode step runs them: us per launch, beside an empty kernel.
// Build: nvcc -O3 -arch=sm_90 -std=c++17 scripts/diag/rms-variants.cu -o rms-variants
// Results: docs/performance.md, "Decode GEMV variants" (2026-12-04).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
namespace cg = cooperative_groups;
#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      exit(1);                                       \
    }                                                \
  } while (0)
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
constexpr int kPer = 32;
template <int NT, typename Acc>
__device__ __forceinline__ float block_scale(Acc ss, int64_t group, float eps) {
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  __shared__ Acc part[NT / 32];
  __shared__ float scale_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc t = 0;
    for (int i = 0; i < NT / 32; ++i) t += part[i];
    scale_s = (float)(Acc(1) / sqrt(t / (Acc)group + (Acc)eps));
  }
  __syncthreads();
  return scale_s;
}
// mode 0: berth's (x + b -> sum, normalised -> out). 1: warp-parallel final (all lanes of warp 0
// sum).
template <int NT, typename Acc, int MODE>
__global__ void __launch_bounds__(NT) rms(const float* x, const float* w, float* out, int64_t group,
                                          float eps, const float* b, float* sum) {
  pdl_enter();
  const float* xr = x;
  float* yr = out;
  const int t = threadIdx.x;
  constexpr int P = (5120 + NT - 1) / NT;
  float v[P], wv[P];
#pragma unroll
  for (int u = 0; u < P; ++u) {
    const int64_t i = t + (int64_t)u * NT;
    v[u] = i < group ? (b ? xr[i] + b[i] : xr[i]) : 0.0f;
    wv[u] = i < group && w ? w[i] : 1.0f;
  }
  Acc ss = 0;
#pragma unroll
  for (int u = 0; u < P; ++u) {
    const Acc d = v[u];
    ss += d * d;
  }
  if (b) {
#pragma unroll
    for (int u = 0; u < P; ++u) {
      const int64_t i = t + (int64_t)u * NT;
      if (i < group) sum[i] = v[u];
    }
  }
  const float scale = block_scale<NT, Acc>(ss, group, eps);
#pragma unroll
  for (int u = 0; u < P; ++u) {
    const int64_t i = t + (int64_t)u * NT;
    if (i < group) yr[i] = w ? v[u] * scale * wv[u] : v[u] * scale;
  }
}
__global__ void empty_k(float* p) {
  pdl_enter();
  if (threadIdx.x == 1000) p[0] = 1;
}

template <typename K, typename... A>
void launch_pdl(K k, int grid, int threads, cudaStream_t s, A... a) {
  cudaLaunchConfig_t c{};
  c.gridDim = grid;
  c.blockDim = threads;
  c.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at;
  c.numAttrs = 1;
  CK(cudaLaunchKernelEx(&c, k, a...));
}
template <typename F>
void time_graph(const char* name, F f) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < 200; ++i) f(s, i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
  CK(cudaStreamSynchronize(s));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> all;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0, s);
    CK(cudaGraphLaunch(ge, s));
    cudaEventRecord(e1, s);
    CK(cudaEventSynchronize(e1));
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    all.push_back(ms * 1000 / 200);
  }
  std::sort(all.begin(), all.end());
  printf("%-40s %6.2f us per launch (min %.2f)\n", name, all[3], all[0]);
}
int main() {
  const int n = 5120;
  float *x, *w, *o, *b, *sm;
  CK(cudaMalloc(&x, n * 4 * 8));
  CK(cudaMalloc(&w, n * 4));
  CK(cudaMalloc(&o, n * 4 * 8));
  CK(cudaMalloc(&b, n * 4 * 8));
  CK(cudaMalloc(&sm, n * 4 * 8));
  CK(cudaMemset(x, 0, n * 32));
  CK(cudaMemset(w, 0, n * 4));
  CK(cudaMemset(b, 0, n * 32));
  time_graph("empty kernel (1 block)",
             [&](cudaStream_t s, int i) { launch_pdl(empty_k, 1, 256, s, o); });
  // alternate buffers so each launch reads the previous one's output (a chain, as in a step)
  time_graph("rms 256 double (berth)", [&](cudaStream_t s, int i) {
    launch_pdl(rms<256, double, 0>, 1, 256, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  time_graph("rms 256 double, no residual", [&](cudaStream_t s, int i) {
    launch_pdl(rms<256, double, 0>, 1, 256, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)nullptr, sm);
  });
  time_graph("rms 256 float", [&](cudaStream_t s, int i) {
    launch_pdl(rms<256, float, 0>, 1, 256, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  time_graph("rms 512 double", [&](cudaStream_t s, int i) {
    launch_pdl(rms<512, double, 0>, 1, 512, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  time_graph("rms 1024 double", [&](cudaStream_t s, int i) {
    launch_pdl(rms<1024, double, 0>, 1, 1024, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  time_graph("rms 1024 float", [&](cudaStream_t s, int i) {
    launch_pdl(rms<1024, float, 0>, 1, 1024, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  time_graph("rms 128 double", [&](cudaStream_t s, int i) {
    launch_pdl(rms<128, double, 0>, 1, 128, s, (const float*)(i & 1 ? o : x), (const float*)w,
               (i & 1 ? x : o), (int64_t)n, 1e-6f, (const float*)b, sm);
  });
  return 0;
}
