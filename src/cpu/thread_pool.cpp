#include "thread_pool.h"

#include <cstdlib>
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define FMKV_HAVE_ATFORK 1
#endif

namespace fmkv::cpu {
namespace {

int configured_threads() {
  const char* e = std::getenv("FMKV_NUM_THREADS");
  int n = e ? std::atoi(e) : 0;
  if (n < 1) n = (int)std::thread::hardware_concurrency();
  return n < 1 ? 1 : n > 256 ? 256 : n;
}

// The process's pool. Never destroyed: worker threads block on its condition variable until the
// process exits, and a pool abandoned by fork() must not be touched (its threads are the parent's).
std::atomic<ThreadPool*> g_pool{nullptr};
std::mutex g_pool_mutex;  // creation only; held across fork() so the child's copy is consistent

#ifdef FMKV_HAVE_ATFORK
void before_fork() { g_pool_mutex.lock(); }
void after_fork_parent() { g_pool_mutex.unlock(); }
void after_fork_child() {
  g_pool.store(nullptr, std::memory_order_relaxed);  // the parent's pool has no threads here
  g_pool_mutex.unlock();
}
#endif

}  // namespace

ThreadPool& ThreadPool::instance() {
  if (ThreadPool* p = g_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> g(g_pool_mutex);
  ThreadPool* p = g_pool.load(std::memory_order_acquire);
  if (!p) {
#ifdef FMKV_HAVE_ATFORK
    static const bool registered = pthread_atfork(before_fork, after_fork_parent, after_fork_child) == 0;
    (void)registered;
#endif
    p = new ThreadPool(configured_threads());
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
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
