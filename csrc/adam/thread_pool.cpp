#include "adam/thread_pool.h"

#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace offloadpp {
namespace adam {
namespace {

// How long an idle pool thread spins for the next call before it sleeps.
constexpr int kSpinMicros = 30;

struct Job {
  ChunkFn fn;
  void* ctx;
  size_t chunks;
  int max_helpers;
  int nice = 0;  // the caller's nice value: helpers run the job at the caller's priority
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  int helpers = 0;     // joined so far (under the pool mutex)
  int running = 0;     // joined and not yet left (under the pool mutex)
  std::condition_variable finished;

  // Takes chunks until none is left; returns how many this thread ran.
  size_t work() {
    size_t ran = 0;
    for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks; ++ran) fn(ctx, c);
    if (ran) done.fetch_add(ran, std::memory_order_acq_rel);
    return ran;
  }
};

class Pool {
 public:
  void run(Job& job, int helpers_wanted) {
    job.nice = getpriority(PRIO_PROCESS, 0);  // Linux: the calling thread's own nice value
    {
      std::lock_guard<std::mutex> lock(mu_);
      grow(helpers_wanted);
      jobs_.push_back(&job);
      ++generation_;
    }
    wake_.notify_all();
    job.work();
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));  // no helper joins from now on
    job.finished.wait(lock, [&] { return job.running == 0 && job.done.load() == job.chunks; });
  }

 private:
  void grow(int helpers) {
    while (static_cast<int>(threads_) < helpers) {
      std::thread([this] { loop(); }).detach();  // the pool lives as long as the process
      ++threads_;
    }
  }

  Job* pick() {  // under mu_
    for (Job* j : jobs_) {
      if (j->helpers < j->max_helpers && j->next.load(std::memory_order_relaxed) < j->chunks) return j;
    }
    return nullptr;
  }

  void loop() {
    int my_nice = getpriority(PRIO_PROCESS, 0);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      Job* job = pick();
      if (job == nullptr) {
        // Back-to-back calls (one per shard) are common: spin briefly before sleeping.
        const unsigned long long seen = generation_;
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
        while (generation_.load(std::memory_order_relaxed) == seen && std::chrono::steady_clock::now() < until) {
          for (int i = 0; i < 16; ++i) pause();
        }
        lock.lock();
        if (generation_ == seen) wake_.wait(lock, [&] { return generation_ != seen; });
        continue;
      }
      ++job->helpers;
      ++job->running;
      const int want = job->nice;
      lock.unlock();
      // Note: a job from a deprioritised caller (the runtime's optimizer worker on the
      // CPU-as-device) must not take a core from torch's threads at normal priority through a
      // helper. Raising priority back may be refused without CAP_SYS_NICE: then it stays lower.
      if (want != my_nice && setpriority(PRIO_PROCESS, 0, want) == 0) my_nice = want;
      job->work();
      lock.lock();
      if (--job->running == 0) job->finished.notify_all();
    }
  }

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Job*> jobs_;
  std::atomic<unsigned long long> generation_{0};
  size_t threads_ = 0;
};

// After fork() only the forking thread exists in the child: give it a fresh pool (the parent's
// object is left behind, its mutex possibly held by a thread that is gone).
std::atomic<Pool*> g_pool{nullptr};

void reset_after_fork() { g_pool.store(nullptr); }

Pool& pool() {
  static const int registered = pthread_atfork(nullptr, nullptr, &reset_after_fork);
  (void)registered;
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Pool* fresh = new Pool();  // never freed: detached threads may still reference it at exit
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;  // another thread won the race (no threads started yet)
  return *p;
}

}  // namespace

void run_chunks(size_t chunks, int max_threads, ChunkFn fn, void* ctx) {
  if (chunks == 0) return;
  const int helpers = static_cast<int>(std::min<size_t>(chunks, static_cast<size_t>(std::max(1, max_threads)))) - 1;
  if (helpers <= 0) {
    for (size_t c = 0; c < chunks; ++c) fn(ctx, c);
    return;
  }
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.chunks = chunks;
  job.max_helpers = helpers;
  pool().run(job, helpers);
}

}  // namespace adam
}  // namespace offloadpp
