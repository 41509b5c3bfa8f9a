// Running one function on several threads at once, shared by the kernels.
#pragma once

#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace nanolab {

// Below this many multiply-adds, sharing the work costs more than it saves. OpenMP's team is started
// already (torch's, whose threads spin a while after each parallel region); threads of our own start
// for each call.
#ifdef NANOLAB_OPENMP
constexpr int64_t kSerialWork = 100000;
#else
constexpr int64_t kSerialWork = 1500000;
#endif

// Calls worker() on n_threads threads, the calling thread one of them, and returns when every call has
// returned. worker must not throw: each kernel catches inside it and passes the error on itself.
//
// Built with OpenMP, the threads are OpenMP's team. Imported after torch's CPU build, this is torch's own
// team (the process has one libgomp.so.1 and torch's was loaded first), whose threads are started already
// and often still spin-waiting after the last matmul. Threads of our own would share the cores with those
// spinning threads; these are the same threads. Without OpenMP, threads are started for the call; if the
// system refuses one, the threads running share the work.
template <class Worker>
void run_threads(int64_t n_threads, Worker& worker) {
  if (n_threads <= 1) {
    worker();
    return;
  }
#ifdef NANOLAB_OPENMP
#pragma omp parallel num_threads(static_cast<int>(n_threads))
  worker();
#else
  std::vector<std::thread> threads;
  for (int64_t i = 1; i < n_threads; ++i) {
    try {
      threads.emplace_back([&worker]() { worker(); });
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (auto& t : threads) t.join();
#endif
}

}  // namespace nanolab
