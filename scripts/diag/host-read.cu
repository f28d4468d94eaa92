// Diagnostic (device): how fast do the CPU workers read each kind of host memory the CPU-held
// experts can live in? 16 pinned threads (one per core, or $THREADS) stream-read 4 GiB with
// 64-byte loads, 5 rounds, the kinds interleaved within each round:
//   anon-thp   malloc'd (aligned, MADV_HUGEPAGE) memory: what the heap would give
//   anon-4k    the same with MADV_NOHUGEPAGE
//   file       a read-only MAP_SHARED mapping of a file in the page cache (the GGUF's pages)
//   hostalloc  cudaHostAlloc (the experts' pinned copy as berth makes it now)
//   anon-reg   anon-thp registered with cudaHostRegister (pinned, yet huge pages for the CPU)
// Build: nvcc -O2 -std=c++17 -Xcompiler -mavx2,-pthread scripts/diag/host-read.cu -o host-read
// Run: ./host-read [GiB]  (prints GB/s per kind per round, then the median per kind)
#include <cuda_runtime.h>
#include <fcntl.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

static void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

static double read_gbs(const char* p, size_t bytes, int threads) {
  std::vector<std::thread> ts;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> secs(threads);
  std::vector<long long> sink(threads);
  const size_t chunk = bytes / threads / 64 * 64;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      cpu_set_t s;
      CPU_ZERO(&s);
      CPU_SET(t, &s);
      pthread_setaffinity_np(pthread_self(), sizeof s, &s);
      const char* b = p + chunk * t;
      ready.fetch_add(1);
      while (!go.load()) {
      }
      auto t0 = std::chrono::steady_clock::now();
      __m256i a0 = _mm256_setzero_si256(), a1 = a0;
      for (size_t i = 0; i < chunk; i += 64) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(b + i + 32)));
      }
      secs[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      a0 = _mm256_add_epi64(a0, a1);
      sink[t] = _mm256_extract_epi64(a0, 0);
    });
  while (ready.load() < threads) {
  }
  go = true;
  for (auto& t : ts) t.join();
  long long s = 0;
  for (long long v : sink) s += v;
  if (s == 42) std::puts("");
  return static_cast<double>(chunk) * threads / *std::max_element(secs.begin(), secs.end()) / 1e9;
}

static char* anon(size_t bytes, bool huge) {
  void* p = nullptr;
  if (posix_memalign(&p, size_t{2} << 20, bytes)) die("posix_memalign");
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(p, 1, bytes);
  return static_cast<char*>(p);
}

int main(int argc, char** argv) {
  const size_t bytes = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 4) << 30;
  const char* te = std::getenv("THREADS");
  const int threads = te ? std::atoi(te) : static_cast<int>(std::thread::hardware_concurrency());
  std::vector<std::pair<std::string, char*>> kinds;
  kinds.emplace_back("anon-thp", anon(bytes, true));
  kinds.emplace_back("anon-4k", anon(bytes, false));
  {
    const char* path = "/tmp/host-read.bin";
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) die("open");
    std::vector<char> buf(64 << 20, 1);
    for (size_t o = 0; o < bytes; o += buf.size())
      if (write(fd, buf.data(), buf.size()) != static_cast<ssize_t>(buf.size())) die("write");
    void* m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) die("mmap");
    close(fd);
    kinds.emplace_back("file", static_cast<char*>(m));
  }
  void* h = nullptr;
  if (cudaHostAlloc(&h, bytes, cudaHostAllocDefault) == cudaSuccess) {
    std::memset(h, 1, bytes);
    kinds.emplace_back("hostalloc", static_cast<char*>(h));
    char* r = anon(bytes, true);
    if (cudaHostRegister(r, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) ==
        cudaSuccess)
      kinds.emplace_back("anon-reg", r);
    else
      std::puts("cudaHostRegister failed: no anon-reg");
  } else {
    std::puts("no CUDA device: no hostalloc, anon-reg");
  }
  std::printf("%d threads, %zu GiB per kind\n", threads, bytes >> 30);
  for (auto& k : kinds) read_gbs(k.second, bytes, threads);  // warm (page tables, caches)
  std::vector<std::vector<double>> got(kinds.size());
  for (int round = 0; round < 5; ++round) {
    for (size_t i = 0; i < kinds.size(); ++i) {
      got[i].push_back(read_gbs(kinds[i].second, bytes, threads));
      std::printf("round %d %-10s %6.1f GB/s\n", round, kinds[i].first.c_str(), got[i].back());
    }
  }
  for (size_t i = 0; i < kinds.size(); ++i) {
    std::sort(got[i].begin(), got[i].end());
    std::printf("median %-10s %6.1f GB/s\n", kinds[i].first.c_str(), got[i][2]);
  }
  // The THP state the kernel gave the anonymous buffers (AnonHugePages, kB).
  std::system(
      "grep -E 'AnonHugePages|Hugepagesize' /proc/meminfo; cat "
      "/sys/kernel/mm/transparent_hugepage/enabled");
  unlink("/tmp/host-read.bin");
  return 0;
}
