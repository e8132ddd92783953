// A small persistent thread pool for the CPU kernels (and, later, the offload
// engine's workers). We do not use at::parallel_for: with torch's OpenMP
// backend it is an inline `#pragma omp parallel`, which would tie this
// extension to a second OpenMP runtime or run serially.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/types.h>
#include <unistd.h>

namespace effmem {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // False in a process forked from the one that made the pool: its workers are not there, and the pool
  // must not be destroyed there (that would wait for them forever).
  bool owned_by_this_process() const { return getpid() == owner_; }

  // Runs fn(i) for i in [0, n), spread over the workers and the calling
  // thread; returns when all are done. The first exception thrown by any
  // fn(i) is rethrown here, after every task has finished.
  void run(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void drain();
  void stop_workers();

  const pid_t owner_;

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t next_ = 0;      // next task index to hand out (guarded by mu_)
  int64_t finished_ = 0;  // tasks completed in this run
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::mutex run_mu_;  // one run() at a time
};

// The pool shared by the CPU kernels, sized to torch.get_num_threads(); it is
// rebuilt if that number changes between calls (a caller still holding the
// old one keeps it alive until it is done).
std::shared_ptr<ThreadPool> intra_op_pool();

}  // namespace effmem
