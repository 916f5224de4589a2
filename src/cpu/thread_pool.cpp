#include "thread_pool.h"

#include <cstdlib>

namespace fmkv::cpu {

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool([] {
    const char* e = std::getenv("FMKV_NUM_THREADS");
    int n = e ? std::atoi(e) : 0;
    if (n < 1) n = (int)std::thread::hardware_concurrency();
    return n < 1 ? 1 : n > 256 ? 256 : n;
  }());
  return pool;
}

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(m_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_items() {
  for (;;) {
    int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= n_) return;
    try {
      (*fn_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(m_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_);
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(m_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_items();
    {
      std::lock_guard<std::mutex> g(m_);
      if (--active_ == 0) cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::unique_lock<std::mutex> run(run_mutex_, std::try_to_lock);
  if (n == 1 || workers_.empty() || !run.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> g(m_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    error_ = nullptr;
    active_ = (int)workers_.size();
    ++generation_;
  }
  cv_start_.notify_all();
  run_items();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(m_);
    cv_done_.wait(lk, [&] { return active_ == 0; });
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace fmkv::cpu
