// Thread-pool backend: queue_depth threads, each running one blocking pread/pwrite at a
// time, so queue_depth operations reach the device together. Always built: it needs only
// POSIX, and it also serves filesystems where the kernel async interfaces are unavailable.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "io/backend.h"

namespace offloadpp {
namespace io {
namespace {

class ThreadPoolBackend final : public Backend {
 public:
  explicit ThreadPoolBackend(unsigned qd) : qd_(qd) {
    threads_.reserve(qd);
    try {
      for (unsigned i = 0; i < qd; ++i) threads_.emplace_back([this] { run(); });
    } catch (const std::system_error& e) {
      stop();
      throw IoError(e.code().value(), "starting I/O thread pool", "", -1);
    }
  }

  ~ThreadPoolBackend() override { stop(); }

  const char* name() const override { return "threadpool"; }
  unsigned queue_depth() const override { return qd_; }

  void submit(const BlockOp* ops, size_t n) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < n; ++i) todo_.push_back(ops[i]);
    }
    if (n == 1) {
      todo_cv_.notify_one();
    } else {
      todo_cv_.notify_all();
    }
  }

  size_t poll(BlockCompletion* out, size_t max) override { return reap(out, 0, max); }
  size_t wait(BlockCompletion* out, size_t min_nr, size_t max) override {
    return reap(out, min_nr == 0 ? 1 : min_nr, max);
  }

 private:
  size_t reap(BlockCompletion* out, size_t min_nr, size_t max) {
    std::unique_lock<std::mutex> lock(mu_);
    if (min_nr > 0) done_cv_.wait(lock, [&] { return done_.size() >= std::min(min_nr, max); });
    size_t got = 0;
    while (got < max && !done_.empty()) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    return got;
  }

  // One syscall per op: short transfers are returned as-is and resubmitted by the engine,
  // the same contract as the kernel interfaces.
  static int64_t execute(const BlockOp& op) {
    for (;;) {
      const ssize_t rc = op.write ? ::pwrite(op.fd, op.buf, op.len, op.offset)
                                  : ::pread(op.fd, op.buf, op.len, op.offset);
      if (rc >= 0) return static_cast<int64_t>(rc);
      if (errno == EINTR) continue;
      return -static_cast<int64_t>(errno);
    }
  }

  void run() {
    for (;;) {
      BlockOp op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        todo_cv_.wait(lock, [&] { return stopping_ || !todo_.empty(); });
        if (todo_.empty()) return;  // stopping and drained
        op = todo_.front();
        todo_.pop_front();
      }
      const int64_t res = execute(op);
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back({op.tag, res});
      }
      done_cv_.notify_one();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    todo_cv_.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }

  unsigned qd_;
  std::mutex mu_;
  std::condition_variable todo_cv_;
  std::condition_variable done_cv_;
  std::deque<BlockOp> todo_;
  std::deque<BlockCompletion> done_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_threadpool_backend(unsigned queue_depth) {
  return std::unique_ptr<Backend>(new ThreadPoolBackend(queue_depth));
}

}  // namespace io
}  // namespace offloadpp
