// The one backend interface: submit block operations, poll (non-blocking) and wait
// (blocking) for their completions. libaio, io_uring and a pread/pwrite thread pool
// implement it; an Engine worker owns one backend instance and drives it from one thread.
#pragma once

#include <memory>
#include <vector>

#include "io/io_common.h"

namespace offloadpp {
namespace io {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // Hands `n` operations to the kernel (or the pool). A per-operation failure at submission
  // (e.g. io_submit rejecting one iocb) is not thrown: it is reported as a completion with
  // res = -errno, so every submitted op yields exactly one completion. The caller never has
  // more than queue_depth() operations outstanding. Throws IoError only when the backend
  // itself is broken.
  virtual void submit(const BlockOp* ops, size_t n) = 0;

  // Collects finished operations into out[0..max); returns how many. poll() never blocks;
  // wait() blocks until at least min_nr (>= 1) are available.
  virtual size_t poll(BlockCompletion* out, size_t max) = 0;
  virtual size_t wait(BlockCompletion* out, size_t min_nr, size_t max) = 0;

  virtual unsigned queue_depth() const = 0;
};

// Builds a backend (never AUTO). Throws IoError naming the failing call (io_setup,
// io_uring_queue_init, ...) and its errno, or when the backend was not compiled in.
std::unique_ptr<Backend> make_backend(BackendKind kind, unsigned queue_depth);

std::unique_ptr<Backend> make_libaio_backend(unsigned queue_depth);
std::unique_ptr<Backend> make_uring_backend(unsigned queue_depth);
std::unique_ptr<Backend> make_threadpool_backend(unsigned queue_depth);

}  // namespace io
}  // namespace offloadpp
