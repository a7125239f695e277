// A tiny persistent thread pool: the calling thread plus (threads - 1)
// workers that spin briefly between jobs and then sleep. Decode issues a
// hundred small jobs per token ~10-50 us apart; waking a sleeping thread
// costs about that much, so workers stay hot for a short while.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvchat {

class ThreadPool {
 public:
  static ThreadPool& instance();

  int size() const {
    return int(workers_.size()) + 1;
  }

  // Runs fn(task) for task in [0, num_tasks), spread over the pool; returns
  // when all are done (rethrowing a task's exception). Re-entrant or
  // concurrent callers run serially inline.
  void run(int num_tasks, const std::function<void(int)>& fn);

  ~ThreadPool();

 private:
  explicit ThreadPool(int threads);
  void worker_loop();
  int claim();    // the next task of the current job, or -1
  void drain();   // claim and run tasks until none is left

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};  // bumped per job: wakes the workers
  // The current job as one word, (num_tasks << 32) | next_task: a worker claims
  // a task by a compare-and-swap on it, so a late worker can never claim a task
  // of a job it did not see published, and the caller waits only for tasks a
  // worker actually claimed (a descheduled worker costs nothing).
  std::atomic<uint64_t> tasks_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;  // the first exception a task threw, rethrown by run()
  const std::function<void(int)>* job_ = nullptr;
};

}  // namespace kvchat
