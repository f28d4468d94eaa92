// The CPU worker pool: a oneTBB task arena whose threads are pinned to physical cores with hwloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace berth {

/// Physical cores this process may run on (hwloc; falls back to hardware_concurrency()).
int physical_core_count();

/// NUMA nodes of the machine (hwloc; 1 when hwloc cannot tell).
int numa_node_count();

/// Bytes of physical memory of the machine (sysconf; 0 when it cannot tell).
size_t physical_memory_bytes();

/// A fixed-size pool of `n_threads` workers (the calling thread counts as one). Each worker is
/// pinned to its own physical core (worker i to the i-th allowed core) when there are at least
/// as many cores as threads; otherwise threads float and a warning is logged. A request for more
/// threads than the machine's hardware threads is lowered to that number (with a warning).
/// Throws Error(invalid_argument) for n_threads < 1.
class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }
  /// True when every worker was bound to a core.
  bool pinned() const;

  /// Calls fn(begin, end) on disjoint chunks covering [0, n), in parallel on the pool, and returns
  /// when all are done. Chunks hold at least `grain` items (except the last). Exceptions thrown
  /// by fn propagate to the caller.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  /// Every thread of the pool (the caller included) busy-waits until `done()` returns true or
  /// `max_us` microseconds have passed, then returns; true when done() held. For waits on
  /// another device that are shorter than oneTBB's spin-before-sleep: the workers stay awake,
  /// so the parallel work that follows does not pay their wake-up (measured by `berth bench
  /// kernels`, "Pool wake-up"). done() is called from every thread and must be thread-safe.
  bool spin_until(const std::function<bool()>& done, int64_t max_us);

  /// Runs fn on the calling thread inside the pool's arena: parallel_for calls made by fn then
  /// skip joining the arena each time (a step of many small ops). Exceptions propagate.
  void execute(const std::function<void()>& fn);

  /// Index of the calling worker in [0, n_threads) while inside parallel_for (scratch slots).
  static int worker_index();

 private:
  struct Impl;
  int n_threads_;
  std::unique_ptr<Impl> impl_;
};

/// Keeps oneTBB's worker threads owned by the program and joins them when it goes out of scope
/// (oneTBB's task_scheduler_handle + finalize). Put one at the top of main(): without it,
/// workers may still be running when the process exits, which sanitizers report as leaks.
/// Every ThreadPool must be destroyed before it.
class WorkerThreadsGuard {
 public:
  WorkerThreadsGuard();
  ~WorkerThreadsGuard();
  WorkerThreadsGuard(const WorkerThreadsGuard&) = delete;
  WorkerThreadsGuard& operator=(const WorkerThreadsGuard&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace berth
