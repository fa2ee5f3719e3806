// io_uring backend (liburing): one ring per backend instance, SQEs batched per submit.
#include <cerrno>
#include <vector>

#include "io/backend.h"

#ifdef OFFLOADPP_HAVE_URING
#include <liburing.h>

namespace offloadpp {
namespace io {
namespace {

class UringBackend final : public Backend {
 public:
  explicit UringBackend(unsigned qd) : qd_(qd) {
    // liburing returns -errno. EPERM/ENOSYS here usually means io_uring is disabled
    // (kernel.io_uring_disabled, seccomp in containers).
    const int rc = io_uring_queue_init(qd, &ring_, 0);
    if (rc < 0) throw IoError(-rc, "io_uring_queue_init(" + std::to_string(qd) + ")", "", -1);
  }

  ~UringBackend() override { io_uring_queue_exit(&ring_); }

  const char* name() const override { return "io_uring"; }
  unsigned queue_depth() const override { return qd_; }

  void submit(const BlockOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) {
        // The SQ ring has qd entries and the engine never exceeds qd outstanding, so this
        // only happens if SQEs from an earlier busy submit linger: push them and retry.
        flush();
        sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) {
          failed_.push_back({ops[i].tag, -EBUSY});
          continue;
        }
      }
      if (ops[i].write) {
        io_uring_prep_write(sqe, ops[i].fd, ops[i].buf, static_cast<unsigned>(ops[i].len), ops[i].offset);
      } else {
        io_uring_prep_read(sqe, ops[i].fd, ops[i].buf, static_cast<unsigned>(ops[i].len), ops[i].offset);
      }
      io_uring_sqe_set_data64(sqe, ops[i].tag);
    }
    flush();
  }

  size_t poll(BlockCompletion* out, size_t max) override { return reap(out, 0, max); }

  size_t wait(BlockCompletion* out, size_t min_nr, size_t max) override {
    return reap(out, min_nr == 0 ? 1 : min_nr, max);
  }

 private:
  // Submits every prepared SQE. EAGAIN/EBUSY (kernel short of resources, CQ full) leave them
  // in the ring: the next submit_and_wait in reap() pushes them, after completions drain.
  void flush() {
    for (;;) {
      const int rc = io_uring_submit(&ring_);
      if (rc == -EINTR) continue;
      if (rc == -EAGAIN || rc == -EBUSY || rc >= 0) return;
      throw IoError(-rc, "io_uring_submit", "", -1);
    }
  }

  size_t reap(BlockCompletion* out, size_t min_nr, size_t max) {
    size_t got = 0;
    while (!failed_.empty() && got < max) {
      out[got++] = failed_.back();
      failed_.pop_back();
    }
    while (got < max) {
      struct io_uring_cqe* cqe = nullptr;
      int rc = io_uring_peek_cqe(&ring_, &cqe);
      if (rc == 0) {
        // cqe->res: bytes transferred or -errno, checked by the engine like io_event.res.
        out[got++] = {io_uring_cqe_get_data64(cqe), static_cast<int64_t>(cqe->res)};
        io_uring_cqe_seen(&ring_, cqe);
        continue;
      }
      if (rc != -EAGAIN) throw IoError(-rc, "io_uring_peek_cqe", "", -1);
      if (got >= min_nr) break;
      rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        throw IoError(-rc, "io_uring_submit_and_wait", "", -1);
      }
    }
    return got;
  }

  unsigned qd_;
  struct io_uring ring_;
  std::vector<BlockCompletion> failed_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth) {
  return std::unique_ptr<Backend>(new UringBackend(queue_depth));
}

}  // namespace io
}  // namespace offloadpp

#else  // !OFFLOADPP_HAVE_URING

namespace offloadpp {
namespace io {
std::unique_ptr<Backend> make_uring_backend(unsigned) {
  throw IoError(ENOSYS, "creating backend io_uring (built without liburing.h)", "", -1);
}
}  // namespace io
}  // namespace offloadpp

#endif
