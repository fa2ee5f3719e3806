#include "io/io_common.h"

#include <cstring>

#include "io/backend.h"

namespace offloadpp {
namespace io {

std::string format_io_error(int err, const std::string& op, const std::string& path, int64_t offset) {
  std::string msg = op + " failed";
  if (!path.empty()) msg += " on " + path;
  if (offset >= 0) msg += " at offset " + std::to_string(offset);
  if (err != 0) {
    char buf[256];
    // GNU strerror_r returns the message pointer (which may or may not be buf).
    const char* s = strerror_r(err, buf, sizeof(buf));
    msg += std::string(": ") + s + " (errno " + std::to_string(err) + ")";
  }
  return msg;
}

IoError::IoError(int err, std::string what_op, std::string path, int64_t offset)
    : std::runtime_error(format_io_error(err, what_op, path, offset)),
      err_(err),
      op_(std::move(what_op)),
      path_(std::move(path)),
      offset_(offset) {}

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::AUTO:
      return "auto";
    case BackendKind::LIBAIO:
      return "libaio";
    case BackendKind::URING:
      return "io_uring";
    case BackendKind::THREADPOOL:
      return "threadpool";
  }
  return "unknown";
}

BackendKind backend_from_name(const std::string& name) {
  if (name == "auto") return BackendKind::AUTO;
  if (name == "libaio" || name == "aio") return BackendKind::LIBAIO;
  if (name == "io_uring" || name == "uring") return BackendKind::URING;
  if (name == "threadpool" || name == "threads" || name == "posix") return BackendKind::THREADPOOL;
  throw std::invalid_argument("unknown I/O backend '" + name +
                              "' (expected one of: auto, libaio, io_uring, threadpool)");
}

bool backend_compiled(BackendKind kind) {
  switch (kind) {
    case BackendKind::LIBAIO:
#ifdef OFFLOADPP_HAVE_LIBAIO
      return true;
#else
      return false;
#endif
    case BackendKind::URING:
#ifdef OFFLOADPP_HAVE_URING
      return true;
#else
      return false;
#endif
    case BackendKind::THREADPOOL:
      return true;
    case BackendKind::AUTO:
      return true;
  }
  return false;
}

std::unique_ptr<Backend> make_backend(BackendKind kind, unsigned queue_depth) {
  if (queue_depth == 0) throw IoError(EINVAL, "creating an I/O backend with queue depth 0", "", -1);
  if (!backend_compiled(kind) || kind == BackendKind::AUTO) {
    throw IoError(ENOSYS, std::string("creating backend ") + backend_name(kind) + " (not compiled in)", "",
                  -1);
  }
  switch (kind) {
    case BackendKind::LIBAIO:
      return make_libaio_backend(queue_depth);
    case BackendKind::URING:
      return make_uring_backend(queue_depth);
    default:
      return make_threadpool_backend(queue_depth);
  }
}

}  // namespace io
}  // namespace offloadpp
