// doctest main for suites that start berth worker pools: joins oneTBB's workers before the
// process exits (berth::WorkerThreadsGuard), as the CLI does, so LeakSanitizer does not report
// the scheduler state of workers still running at exit.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "berth/backends/thread_pool.h"

int main(int argc, char** argv) {
  berth::WorkerThreadsGuard workers;
  doctest::Context context(argc, argv);
  return context.run();
}
