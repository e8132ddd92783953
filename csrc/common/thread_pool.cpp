#include "common/thread_pool.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <memory>

namespace effmem {

ThreadPool::ThreadPool(int num_threads) : owner_(getpid()) {
  try {
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  } catch (...) {  // a thread could not start (a pid limit, memory): stop those that did, then report it
    stop_workers();
    throw;
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

// Takes task indices until none are left. Called by workers and by run().
void ThreadPool::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  while (next_ < n_) {
    const int64_t i = next_++;
    const auto* fn = fn_;
    lock.unlock();
    std::exception_ptr err;
    try {
      (*fn)(i);
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    if (err && !error_) error_ = err;
    if (++finished_ == n_) done_.notify_all();
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ThreadPool::run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (n == 1 || workers_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    finished_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  drain();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return finished_ == n_; });
    err = error_;
    fn_ = nullptr;
    n_ = 0;
    next_ = 0;
  }
  if (err) std::rethrow_exception(err);
}

std::shared_ptr<ThreadPool> intra_op_pool() {
  static std::mutex mu;
  // Never destroyed at exit: a forked child that exits without calling this again would run the parent's
  // pool's destructor, joining threads that do not exist in it and destroying condition variables their
  // waits still count (a child of a process that had run FusedAdam with 2 threads hung at sys.exit, or
  // aborted). At the parent's exit its workers are waiting on a condition variable that is never destroyed.
  static auto* const pool_ptr = new std::shared_ptr<ThreadPool>();
  auto& pool = *pool_ptr;
  std::lock_guard<std::mutex> lock(mu);
  const int want = std::max(1, at::get_num_threads());
  if (pool && !pool->owned_by_this_process()) {
    // A forked child (a DataLoader worker): the parent's pool has no threads here, and destroying it would
    // wait for them forever (joins, and condition variables they were waiting on). It is left, never freed.
    new std::shared_ptr<ThreadPool>(std::move(pool));
  }
  if (!pool || pool->size() != want) pool = std::make_shared<ThreadPool>(want);
  return pool;
}

}  // namespace effmem
