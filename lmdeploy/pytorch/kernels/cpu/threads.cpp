// Pins the OpenMP worker threads of the calling thread's team to CPUs, worker i to cpus[i % size];
// the calling thread (thread 0) keeps its affinity. Linux only; elsewhere it does nothing.
#include "common.h"

#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

void bind_worker_threads(const std::vector<int64_t>& cpus) {
  TORCH_CHECK(!cpus.empty(), "bind_worker_threads: no CPUs given");
#if defined(__linux__)
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int thread = omp_get_thread_num();
    if (thread > 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[thread % cpus.size()]), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
  }
#endif
}
