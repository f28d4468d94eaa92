#include "berth/backends/thread_pool.h"

#include <hwloc.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "berth/core/error.h"
#include "berth/core/log.h"

namespace berth {
namespace {

// One hwloc topology for the process (loading it costs milliseconds).
struct Topology {
  hwloc_topology_t topo = nullptr;
  Topology() {
    if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) {
      if (topo) hwloc_topology_destroy(topo);
      topo = nullptr;
    }
  }
  ~Topology() {
    if (topo) hwloc_topology_destroy(topo);
  }
  int n_cores() const {
    if (!topo) return 0;
    return hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  }
  int n_numa() const {
    if (!topo) return 0;
    return hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  }
  int n_pus() const {
    if (!topo) return 0;
    return hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  }
  // Binds the calling thread to the PUs of core `i`; returns false on failure.
  bool bind_current_thread(int i) const {
    if (!topo) return false;
    hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, static_cast<unsigned>(i));
    if (!core || !core->cpuset) return false;
    return hwloc_set_cpubind(topo, core->cpuset, HWLOC_CPUBIND_THREAD) == 0;
  }
};

const Topology& topology() {
  static Topology t;
  return t;
}

}  // namespace

int physical_core_count() {
  int n = topology().n_cores();
  if (n > 0) return n;
  unsigned hc = std::thread::hardware_concurrency();
  return hc > 0 ? static_cast<int>(hc) : 1;
}

int numa_node_count() { return std::max(topology().n_numa(), 1); }

size_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

// Pins each thread that enters the arena to the core of its arena slot. The calling (master)
// thread is pinned too while the pool lives; its previous binding is saved and restored by
// ~ThreadPool, so a process that later starts children (which inherit the binding) or other
// pools is not left confined to one core.
class PinningObserver : public oneapi::tbb::task_scheduler_observer {
 public:
  PinningObserver(oneapi::tbb::task_arena& arena, int n_threads)
      : task_scheduler_observer(arena), n_threads_(n_threads) {}
  ~PinningObserver() override {
    if (saved_) hwloc_bitmap_free(saved_);
  }

  void on_scheduler_entry(bool is_worker) override {
    const int slot = oneapi::tbb::this_task_arena::current_thread_index();
    if (slot < 0 || slot >= n_threads_) return;
    if (!is_worker) {
      std::lock_guard<std::mutex> lock(mu_);
      if (master_pinned_) return;  // pinned on an earlier entry
      master_pinned_ = true;
      master_ = std::this_thread::get_id();
      saved_ = hwloc_bitmap_alloc();
      if (!topology().topo ||
          hwloc_get_cpubind(topology().topo, saved_, HWLOC_CPUBIND_THREAD) != 0) {
        hwloc_bitmap_free(saved_);
        saved_ = nullptr;
      }
    }
    // Workers leave the arena when it runs dry and re-enter at the next parallel region, often
    // into the same slot: skip the binding system call when this thread already holds that
    // slot's core (for this pool).
    thread_local const PinningObserver* bound_pool = nullptr;
    thread_local int bound_slot = -1;
    if (is_worker && bound_pool == this && bound_slot == slot) return;
    if (!topology().bind_current_thread(slot)) {
      failed_.store(true);
      return;
    }
    if (is_worker) {
      bound_pool = this;
      bound_slot = slot;
    }
  }

  /// Restores the master thread's binding; call on the thread that created the pool.
  void restore_master() {
    std::lock_guard<std::mutex> lock(mu_);
    if (master_pinned_ && saved_ && std::this_thread::get_id() == master_)
      hwloc_set_cpubind(topology().topo, saved_, HWLOC_CPUBIND_THREAD);
    master_pinned_ = false;
  }
  bool failed() const { return failed_.load(); }

 private:
  int n_threads_;
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  bool master_pinned_ = false;
  std::thread::id master_;
  hwloc_bitmap_t saved_ = nullptr;
};

struct ThreadPool::Impl {
  oneapi::tbb::task_arena arena;
  std::unique_ptr<PinningObserver> observer;
  bool pin = false;
  explicit Impl(int n) : arena(n, /*reserved_for_masters=*/1) {}
};

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads) {
  if (n_threads < 1)
    throw Error(ErrorCategory::invalid_argument,
                fmt::format("the number of threads must be at least 1, got {}", n_threads));
  // More threads than hardware threads only adds contention (and oneTBB caps them anyway).
  int pus = topology().n_pus();
  if (pus <= 0) pus = static_cast<int>(std::thread::hardware_concurrency());
  if (pus > 0 && n_threads > pus) {
    log::warn("{} threads requested but this machine runs {} at once; using {}", n_threads, pus,
              pus);
    n_threads = n_threads_ = pus;
  }
  impl_ = std::make_unique<Impl>(n_threads);
  impl_->arena.initialize();
  const int cores = topology().n_cores();
  impl_->pin = cores >= n_threads;
  log::info("worker pool: {} threads{}", n_threads,
            impl_->pin ? ", each pinned to its own physical core" : " (not pinned)");
  if (impl_->pin) {
    impl_->observer = std::make_unique<PinningObserver>(impl_->arena, n_threads);
    impl_->observer->observe(true);
  } else {
    log::warn(
        "{} threads requested but only {} physical cores are available; threads are not pinned",
        n_threads, cores);
  }
}

ThreadPool::~ThreadPool() {
  if (impl_ && impl_->observer) {
    impl_->observer->observe(false);
    impl_->observer->restore_master();
  }
}

bool ThreadPool::pinned() const {
  return impl_->pin && !(impl_->observer && impl_->observer->failed());
}

int ThreadPool::worker_index() {
  const int i = oneapi::tbb::this_task_arena::current_thread_index();
  return i < 0 ? 0 : i;
}

void ThreadPool::execute(const std::function<void()>& fn) { impl_->arena.execute(fn); }

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  if (n_threads_ == 1 || n <= grain) {
    impl_->arena.execute([&] { fn(0, n); });
    return;
  }
  impl_->arena.execute([&] {
    oneapi::tbb::parallel_for(
        oneapi::tbb::blocked_range<int64_t>(0, n, static_cast<size_t>(grain)),
        [&](const oneapi::tbb::blocked_range<int64_t>& r) { fn(r.begin(), r.end()); },
        oneapi::tbb::simple_partitioner());
  });
}

bool ThreadPool::spin_until(const std::function<bool()>& done, int64_t max_us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(max_us);
  auto spin = [&] {
    for (int i = 0;; ++i) {
      if (done()) return true;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return false;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  };
  if (n_threads_ == 1) return spin();
  std::atomic<bool> ok{false};
  parallel_for(n_threads_, 1, [&](int64_t, int64_t) {
    if (spin()) ok.store(true, std::memory_order_relaxed);
  });
  return ok.load(std::memory_order_relaxed) || done();
}

struct WorkerThreadsGuard::Impl {
  oneapi::tbb::task_scheduler_handle handle{oneapi::tbb::attach{}};
};

WorkerThreadsGuard::WorkerThreadsGuard() : impl_(std::make_unique<Impl>()) {}

WorkerThreadsGuard::~WorkerThreadsGuard() {
  // Waits for the workers to exit; returns false (and we carry on) if a pool is still alive.
  (void)oneapi::tbb::finalize(impl_->handle, std::nothrow);
}

}  // namespace berth
