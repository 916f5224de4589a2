// Fixed-size thread pool of the CPU backend (std::thread). parallel_for hands out indices
// dynamically; callers make results independent of the thread count by giving every index its own
// output and merging in index order afterwards.
// Size: FMKV_NUM_THREADS (>= 1) if set, else std::thread::hardware_concurrency().
// Fork-safe: a forked child (multiprocessing's default on Linux) has none of the parent's workers,
// so instance() builds a fresh pool there (pthread_atfork); the parent's pool object is left
// untouched in the child (its threads do not exist there and its locks may be held).
#pragma once
#include <atomic>
#include <condition_variable>
#include <exception>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace fmkv::cpu {

class ThreadPool {
 public:
  static ThreadPool& instance();  // the process's pool, created on first use (per process after fork)
  int num_threads() const { return (int)workers_.size() + 1; }
  // fn(i) for every i in [0, n); the calling thread takes part. Rethrows the first exception.
  // A call made while another is running (from another thread) runs serially in the caller.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);
  ~ThreadPool();

 private:
  explicit ThreadPool(int threads);
  void worker_loop();
  void run_items();

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one parallel_for at a time
  std::mutex m_;
  std::condition_variable cv_start_, cv_done_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  int active_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

}  // namespace fmkv::cpu
