#include "pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sched.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define KVCHAT_PAUSE() asm volatile("yield")
#else
#define KVCHAT_PAUSE() ((void)0)
#endif

namespace kvchat {

namespace {
// How long an idle worker keeps spinning before it sleeps. Longer spins make
// back-to-back jobs cheaper but steal a core from MLX's own thread on a
// 2-core machine (measured: erratic 5-10x slowdowns with ~1 ms of spinning).
// With decode steps launched ahead, Python builds the next step meanwhile and
// needs that core too. A worker spins as long as its last job took, 5 to 50 us
// (KVCHAT_SPIN_US: the cap; KVCHAT_SPIN_SHARE=N: 1/N of the job, 0: the cap
// always). Three interleaved rounds (Zen 5), ms a decoded token, medians: 135M
// 5.4 against 6.0 for a fixed 50 us (5.35 for a fixed 10), 1B Q4_0 17.8 against
// 19.4 (18.5); it beat the fixed 50 us in 2 of 3 rounds (135M) and 3 of 3 (1B).
std::chrono::microseconds spin_time() {
  static const int us = [] {
    const char* env = std::getenv("KVCHAT_SPIN_US");
    return env ? std::max(5, std::atoi(env)) : 50;
  }();
  return std::chrono::microseconds(us);
}

int spin_share() {
  static const int n = [] {
    const char* env = std::getenv("KVCHAT_SPIN_SHARE");
    return env ? std::max(0, std::atoi(env)) : 1;
  }();
  return n;
}

int pool_threads() {
  if (const char* env = std::getenv("KVCHAT_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return n > 64 ? 64 : n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw >= 2 ? 2 : 1;  // 2 cores on the build machines; more bandwidth is not there
}
}  // namespace

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads during interpreter teardown can hang.
  static ThreadPool* pool = new ThreadPool(pool_threads());
  return *pool;
}

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_++;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::claim() {
  uint64_t cur = tasks_.load(std::memory_order_acquire);
  while (uint32_t(cur) < uint32_t(cur >> 32)) {
    if (tasks_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire))
      return int(uint32_t(cur));
  }
  return -1;
}

void ThreadPool::drain() {
  // job_ is read only after a claim: the job that published the claimed task
  // cannot return before done_ counts it, so the pointer stays valid.
  for (int t = claim(); t >= 0; t = claim()) {
    try {
      (*job_)(t);
    } catch (...) {  // an exception must not leave a worker thread (std::terminate)
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  auto spin = spin_time();
  while (true) {
    const auto spin_until = std::chrono::steady_clock::now() + spin;
    for (int spins = 0; generation_.load(std::memory_order_acquire) == seen && !stop_;) {
      if (++spins % 64 != 0 || std::chrono::steady_clock::now() < spin_until) {
        KVCHAT_PAUSE();
        continue;
      }
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      wake_.wait(lock, [&] { return generation_.load() != seen || stop_; });
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    }
    if (stop_) return;
    seen = generation_.load(std::memory_order_acquire);
    const auto start = std::chrono::steady_clock::now();
    drain();
    // short jobs (a small model's decode) come with Python building the next step
    const auto busy = std::chrono::duration_cast<std::chrono::microseconds>(
        std::chrono::steady_clock::now() - start);
    spin = spin_share() ? std::clamp(busy / spin_share(), std::chrono::microseconds(5),
                                     spin_time())
                        : spin_time();
  }
}

void ThreadPool::run(int num_tasks, const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> guard(run_mutex_, std::try_to_lock);
  if (workers_.empty() || num_tasks <= 1 || !guard.owns_lock()) {
    for (int t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  job_ = &fn;
  done_.store(0, std::memory_order_relaxed);
  tasks_.store(uint64_t(uint32_t(num_tasks)) << 32, std::memory_order_release);
  // A worker going to sleep just as this reads 0 misses this one job (the
  // caller runs its tasks); the next job wakes it.
  if (sleepers_.load() > 0) {
    // Publishing under the mutex pairs with the sleepers' predicate check.
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    wake_.notify_all();
  } else {
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  drain();
  // Every task is claimed now; wait only for those a worker is still running.
  // One that was preempted mid-task (a loaded machine) gets the core back.
  for (int spins = 0; done_.load(std::memory_order_acquire) != num_tasks; ++spins) {
    if (spins < 2000)
      KVCHAT_PAUSE();
    else
      sched_yield();
  }
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace kvchat
