// libaio backend: one io_context per backend instance, batched io_submit, io_getevents.
#include <cerrno>
#include <ctime>
#include <vector>

#include "io/backend.h"

#ifdef OFFLOADPP_HAVE_LIBAIO
#include <libaio.h>

namespace offloadpp {
namespace io {
namespace {

class LibaioBackend final : public Backend {
 public:
  explicit LibaioBackend(unsigned qd) : qd_(qd), iocbs_(qd), iocb_ptrs_(qd), events_(qd) {
    // libaio returns -errno instead of setting errno.
    const int rc = io_setup(static_cast<int>(qd), &ctx_);
    if (rc < 0) throw IoError(-rc, "io_setup(" + std::to_string(qd) + ")", "", -1);
  }

  ~LibaioBackend() override {
    // The Engine drains every outstanding op before destroying its backend, so io_destroy can
    // only fail on a context that is already gone; a destructor has no one to tell.
    (void)io_destroy(ctx_);
  }

  const char* name() const override { return "libaio"; }
  unsigned queue_depth() const override { return qd_; }

  void submit(const BlockOp* ops, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      struct iocb* cb = &iocbs_[i];
      if (ops[i].write) {
        io_prep_pwrite(cb, ops[i].fd, ops[i].buf, ops[i].len, ops[i].offset);
      } else {
        io_prep_pread(cb, ops[i].fd, ops[i].buf, ops[i].len, ops[i].offset);
      }
      cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(ops[i].tag));
      iocb_ptrs_[i] = cb;
    }
    size_t done = 0;
    while (done < n) {
      // One io_submit per batch: the kernel copies the iocbs, so the array is reusable after.
      const int rc = io_submit(ctx_, static_cast<long>(n - done), iocb_ptrs_.data() + done);
      if (rc > 0) {
        done += static_cast<size_t>(rc);
      } else if (rc == -EINTR) {
        continue;
      } else if (rc == -EAGAIN && done < n) {
        // Kernel resources exhausted for now: report the op as failed with EAGAIN rather
        // than spinning; the engine surfaces it as an error on that request.
        failed_.push_back({ops[done].tag, -EAGAIN});
        ++done;
      } else {
        // rc < 0 (or 0): the first remaining iocb was rejected (EINVAL for misalignment,
        // EBADF, ...). It never reaches the kernel queue, so complete it here and go on.
        failed_.push_back({ops[done].tag, rc < 0 ? static_cast<int64_t>(rc) : -EIO});
        ++done;
      }
    }
  }

  size_t poll(BlockCompletion* out, size_t max) override { return reap(out, 0, max); }

  size_t wait(BlockCompletion* out, size_t min_nr, size_t max) override {
    return reap(out, min_nr == 0 ? 1 : min_nr, max);
  }

 private:
  size_t reap(BlockCompletion* out, size_t min_nr, size_t max) {
    size_t got = 0;
    while (!failed_.empty() && got < max) {
      out[got++] = failed_.back();
      failed_.pop_back();
    }
    if (got >= max) return got;
    const size_t want_min = got >= min_nr ? 0 : min_nr - got;
    const size_t want_max = std::min<size_t>(max - got, events_.size());
    for (;;) {
      struct timespec zero = {0, 0};
      const int rc = io_getevents(ctx_, static_cast<long>(want_min), static_cast<long>(want_max),
                                  events_.data(), want_min == 0 ? &zero : nullptr);
      if (rc == -EINTR) continue;
      if (rc < 0) throw IoError(-rc, "io_getevents", "", -1);
      for (int i = 0; i < rc; ++i) {
        // io_event.res is unsigned long in the ABI; negative errno values wrap.
        const int64_t res = static_cast<int64_t>(static_cast<long>(events_[i].res));
        out[got++] = {static_cast<uint64_t>(reinterpret_cast<uintptr_t>(events_[i].data)), res};
      }
      return got;
    }
  }

  unsigned qd_;
  io_context_t ctx_ = nullptr;
  std::vector<struct iocb> iocbs_;
  std::vector<struct iocb*> iocb_ptrs_;
  std::vector<struct io_event> events_;
  std::vector<BlockCompletion> failed_;
};

}  // namespace

std::unique_ptr<Backend> make_libaio_backend(unsigned queue_depth) {
  return std::unique_ptr<Backend>(new LibaioBackend(queue_depth));
}

}  // namespace io
}  // namespace offloadpp

#else  // !OFFLOADPP_HAVE_LIBAIO

namespace offloadpp {
namespace io {
std::unique_ptr<Backend> make_libaio_backend(unsigned) {
  throw IoError(ENOSYS, "creating backend libaio (built without libaio.h)", "", -1);
}
}  // namespace io
}  // namespace offloadpp

#endif
