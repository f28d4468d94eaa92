// Kernel launches with programmatic dependent launch (PDL; CUDA Programming Guide, "Programmatic
// Dependent Launch and Synchronization"; compute capability 9.0 and later).
//
// A kernel launched with the programmatic-stream-serialization attribute may be scheduled while
// the kernel before it in the stream still runs, once every block of that one has executed
// griddepcontrol.launch_dependents (or exited). Its blocks then wait in griddepcontrol.wait until
// every prerequisite grid has completed and its writes are visible. Decode steps are chains of
// small dependent kernels: the next kernel's launch and block dispatch overlap the current one's
// execution instead of following its end.
//
// The contract every kernel of gpu_kernels/ keeps: its first statement is pdl_enter() (the wait,
// then the trigger), before any global memory access, so a kernel never reads or writes anything
// before its predecessors are complete, and each kernel holds its dependents back until it has
// itself started (at most one kernel waits ahead). Since every kernel waits at its start, a kernel
// completes only after its predecessor has, so the ordering is transitive along the stream.
// Kernels launched without the attribute (or not by launch()) see both instructions as no-ops.
// Dependencies other than the previous kernel (events, copies, host nodes) are kept as before.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "check.cuh"

namespace berth::gpu {

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// True when the environment variable `name` is 0, false, off or no (any case); unset or any
/// other value: false.
bool env_says_off(const char* name);
/// True when the environment variable `name` is 1, true, on or yes (any case).
bool env_says_on(const char* name);

/// Whether the current device has compute capability >= `major`.0 and runs code of this build
/// compiled for a virtual architecture >= `major`.0 (a PTX JIT from an older target would run a
/// kernel with its newer-architecture body compiled out). Read once per device and major.
bool device_code_at_least(int major);

/// Thread-block-cluster kernels: device_code_at_least(9).
bool cluster_kernels_available();

/// The mma.sync / ldmatrix / cp.async kernels (mma.cuh): device_code_at_least(8).
bool mma_kernels_available();

/// Raises the dynamic shared memory limit of `kernel` on the current device to at least `bytes`
/// (kernels need it above 48 KiB), once per (kernel, device) and size. Errors: Error(internal)
/// when the device refuses (bytes above its opt-in maximum).
void allow_dynamic_smem(const void* kernel, size_t bytes);
template <typename... P>
void allow_dynamic_smem(void (*kernel)(P...), size_t bytes) {
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

/// Blocks of `threads` threads for a grid-stride loop over n elements: enough for one element
/// per thread, at least 1 and at most 65536 (the loops stride over the rest).
inline unsigned grid_stride_blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65536 ? 65536 : b));
}

/// Whether launch() asks for PDL on the current device: compute capability >= 9.0, and neither
/// set_pdl(false) nor the environment variable BERTH_PDL=0 turned it off (kernels.h).
bool pdl_active();

/// Launches `kernel` on `stream` (with the PDL attribute when pdl_active()); a rejected launch
/// throws Error(internal) naming `name`. cluster_x > 1 groups the blocks into thread block
/// clusters of cluster_x blocks along x (compute capability >= 9.0; grid.x a multiple of it).
template <typename... P, typename... A>
void launch_in_clusters(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                        cudaStream_t stream, unsigned cluster_x, A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2]{};
  unsigned n = 0;
  if (pdl_active()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cfg.attrs = n ? attr : nullptr;
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(std::forward<A>(args))...);
  if (e != cudaSuccess) throw_cuda(e, name);
}

template <typename... P, typename... A>
void launch(const char* name, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
            cudaStream_t stream, A&&... args) {
  launch_in_clusters(name, kernel, grid, block, smem, stream, 1, std::forward<A>(args)...);
}

}  // namespace berth::gpu
